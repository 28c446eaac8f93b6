"""What a restarted persistent disk tier may trust (SPEC §7: the slot file is this
user's alone; a restart serves only what this user's engine wrote there).

Regressions: a reused slot file or manifest was trusted whatever its owner and mode, and
`recovered_slots()` kept listing slots this run had overwritten since.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import test_worker_persist as persist
from transfer_helpers import block_bytes, job, make_worker, run_plan

from kvtier.core.keys import make_key
from kvtier.offload.plan import SlotRecord, Tier, TransferJob

pytestmark = pytest.mark.timeout(60)

OTHER_UID = 65534  # nobody


def _restart_recovers(tmp_path: Path) -> list[tuple[int, SlotRecord]]:
    with make_worker(persist.config(tmp_path), persist.new_kv(seed=2)) as worker:
        return worker.recovered_slots()


@pytest.mark.parametrize("which", ["slots", "manifest"])
def test_a_file_others_may_write_is_discarded(
    tmp_path: Path, which: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user who can rewrite the slot file (or its manifest, which holds the
    checksums) could make a restart serve KV of their choosing: both are discarded."""
    persist.first_run(tmp_path)
    slots, manifest = persist.paths(tmp_path)
    os.chmod(slots if which == "slots" else manifest, 0o666)
    with caplog.at_level(logging.WARNING):
        assert _restart_recovers(tmp_path) == []
    assert "writable by group or others (mode 0o666)" in caplog.text
    assert os.stat(slots).st_mode & 0o777 == 0o600  # recreated, this user's alone
    assert _restart_recovers(tmp_path) == []  # and the fresh pair is trusted from now on


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_files_another_user_owns_are_discarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Files planted by another user (mode 0600, their uid) are not this user's cache."""
    persist.first_run(tmp_path)
    for path in persist.paths(tmp_path):
        os.chown(path, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING):
        assert _restart_recovers(tmp_path) == []
    assert f"owned by uid {OTHER_UID}" in caplog.text
    assert os.stat(persist.paths(tmp_path)[0]).st_uid == os.geteuid()


def test_a_trusted_restart_still_recovers(tmp_path: Path) -> None:
    persist.first_run(tmp_path)
    assert [slot for slot, _ in _restart_recovers(tmp_path)] == [3, 5, 7, 9]


def test_recovered_slots_drops_a_slot_this_run_overwrote(tmp_path: Path) -> None:
    """Slot 3 was recovered holding key 3; this run stores another key's block there. A
    restore from the old list would serve the new bytes (whose checksum verifies) under
    key 3: the slot is no longer listed once its write is queued."""
    images = persist.first_run(tmp_path)
    with make_worker(persist.config(tmp_path), persist.new_kv(seed=2)) as worker:
        assert (3, persist.rec(3)) in worker.recovered_slots()
        other = SlotRecord(make_key(b"\x77" * 32, 0), 16)
        overwrite = TransferJob(1, Tier.GPU, Tier.DISK, (10,), (3,), (other,))
        assert dict(run_plan(worker, overwrite).done) == {1: 1}
        assert [slot for slot, _ in worker.recovered_slots()] == [5, 7, 9]
        assert dict(run_plan(worker, job(2, Tier.DISK, Tier.GPU, [3], [20])).done) == {2: 1}
        assert block_bytes(worker.regions, 20) != images[3]  # what key 3 would have got


@pytest.mark.parametrize("bad", [16.0, None, "16", True, -1], ids=repr)
def test_a_record_with_a_bad_token_count_is_refused_at_submit(tmp_path: Path, bad: object) -> None:
    """A non-int count passed the record check, then failed the manifest encoder on the
    store I/O thread with a bare struct error (or a TypeError naming nothing)."""
    with make_worker(persist.config(tmp_path), persist.new_kv(seed=2)) as worker:
        record = SlotRecord(make_key(b"\x77" * 32, 0), bad)  # type: ignore[arg-type]
        store = TransferJob(1, Tier.GPU, Tier.DISK, (10,), (3,), (record,))
        with pytest.raises(ValueError, match=f"num_tokens must be an int .*got {bad!r}"):
            run_plan(worker, store)
