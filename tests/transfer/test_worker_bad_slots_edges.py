"""Edges of a disk load with bad slots: a copy failing after a bad batch names nothing;
a slot read twice in one event (two requests sharing a block) is named once and every
other destination holds its slot's bytes, whatever the batch boundaries."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from test_worker_bad_slots import SLOT_KV, config, corrupt_slot
from transfer_helpers import block_bytes, fill_random, job, kv_per_layer, make_worker, run_plan

from kvtier.offload.plan import Tier
from kvtier.transfer.copiers import CpuCopier, StagingRows

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("failing_copy", [1, 2, 3], ids=["good-rows", "next-batch", "last"])
def test_a_copy_failing_beside_a_bad_slot_fails_the_whole_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_copy: int
) -> None:
    """Batch 0 (slots 0, 1) has bad slot 0: its good row is copied (copy 1), then batches
    1 and 2 (copies 2, 3). Any of them raising leaves destinations unknown: no names."""
    kv = kv_per_layer(2, 32, SLOT_KV)
    fill_random(kv, seed=31)
    with make_worker(config(tmp_path, 2), kv) as w:
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 0)
        calls = []
        copy = CpuCopier.load_from_staging

        def flaky(
            self: CpuCopier, staging: StagingRows, dst: list[torch.Tensor], ids: np.ndarray
        ) -> None:
            calls.append(len(ids))
            if len(calls) == failing_copy:
                raise RuntimeError("copy failed")
            copy(self, staging, dst, ids)

        monkeypatch.setattr(CpuCopier, "load_from_staging", flaky)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [0, 1, 2, 3, 4, 5], range(10, 16)))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {})
        assert dict(report.seconds) == {}  # nothing known copied: no copy time


@pytest.mark.parametrize("batch_slots", [1, 2, 3, 16])
def test_a_bad_slot_read_twice_is_named_once_and_the_others_are_copied(
    tmp_path: Path, batch_slots: int
) -> None:
    kv = kv_per_layer(2, 32, SLOT_KV)
    fill_random(kv, seed=32)
    with make_worker(config(tmp_path, batch_slots), kv) as w:
        images = {s: block_bytes(w.regions, b) for b, s in [(1, 4), (2, 5), (3, 6)]}
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3], [4, 5, 6]))
        fill_random(kv, seed=33)
        src, dst = [5, 4, 6, 5, 4], [10, 11, 12, 13, 14]
        before = {d: block_bytes(w.regions, d) for d in dst}
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 5)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, src, dst))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {2: frozenset({5})})
        for s, d in zip(src, dst, strict=True):
            assert block_bytes(w.regions, d) == (before[d] if s == 5 else images[s]), (s, d)


def test_a_partly_loaded_event_reports_its_copy_time(tmp_path: Path) -> None:
    """The good blocks of a load with a bad slot were copied: the report times them
    (`WorkerReport.seconds`), for the transfer statistics."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=33)
    with make_worker(config(tmp_path, 2), kv) as w:
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3], [0, 1, 2]))
        assert w.disk_path is not None
        corrupt_slot(w.disk_path, 1)
        report = run_plan(w, job(2, Tier.DISK, Tier.GPU, [0, 1, 2], [8, 9, 10]))
        assert (dict(report.failed), dict(report.bad_blocks)) == ({2: 1}, {2: frozenset({1})})
        assert set(report.seconds) == {2}
        assert report.seconds[2] >= 0.0


def test_the_error_of_a_load_with_bad_slots_in_several_reads_counts_them_consistently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the first read's count came first, unqualified, so the logged error
    read "slot 0 ... (and 1 more bad slots) (3 bad slots: [0, 1, 4])"."""
    kv = kv_per_layer(2, 16, SLOT_KV)
    fill_random(kv, seed=34)
    with make_worker(config(tmp_path, 2), kv) as w:
        run_plan(w, job(1, Tier.GPU, Tier.DISK, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]))
        assert w.disk_path is not None
        for slot in (0, 1, 4):  # two bad slots in the first read, one in the third
            corrupt_slot(w.disk_path, slot)
        with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
            report = run_plan(w, job(2, Tier.DISK, Tier.GPU, range(6), range(8, 14)))
        assert dict(report.bad_blocks) == {2: frozenset({0, 1, 4})}
    assert (
        "checksum mismatch in slot 0 (and 1 more bad slot in this read);"
        " 3 bad slots in the load: [0, 1, 4]" in caplog.text
    )
