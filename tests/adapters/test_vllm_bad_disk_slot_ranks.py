"""Corrupted disk slots on either of two ranks, or on both (for different requests).

The rank that finds a bad slot names it and reports the GPU block it was copied into as a
load error (none in `failed_recving`); vLLM's union of the ranks' load errors is exactly
the first block of each request reading a bad slot on some rank, and the scheduler
recomputes the same requests. The harness checks every loaded block's content (never
wrong KV).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    offload_worker,
)
from test_vllm_bad_disk_slot import (
    record_failed,
    record_recomputed,
    serve_again,
    stored_and_evicted,
)
from test_vllm_partial_load_failure import CorruptSlot


@pytest.mark.parametrize(
    "corrupt",
    [((0, 0),), ((0, 1),), ((0, 0), (1, 1)), ((0, 1), (1, 1))],
    ids=["rank0-first", "rank0-second", "each-rank-its-own", "both-ranks-the-second"],
)
def test_each_rank_fails_only_the_readers_of_its_bad_slots(
    tmp_path: Path, corrupt: tuple[tuple[int, int], ...]
) -> None:
    """`corrupt`: (rank, which request's first slot) pairs."""
    extra = {"cpu_bytes": 0, "disk_bytes": 256 * SLOT_BYTES, "disk_path": str(tmp_path)}
    extra["disk_io_mode"] = "page_cache"
    harness = kvtier_harness(extra=extra, num_ranks=2)
    prompts = stored_and_evicted(harness)
    wraps = [
        (CorruptSlot(offload_worker(harness, rank=r), which, byte=0), which) for r, which in corrupt
    ]
    reported: set[str] = set()
    invalid: set[int] = set()
    for rank in range(2):
        record_failed(harness, rank, reported, invalid)
    recomputed = record_recomputed(harness)
    serve_again(harness, prompts)
    assert all(wrap.slot is not None for wrap, _ in wraps)
    bad = {wrap.request_ids[which] for wrap, which in wraps}
    assert reported == set()
    assert len(invalid) == len(bad)  # each one's first GPU block: it keeps nothing
    assert sorted(recomputed) == sorted(bad)
    check_quiescent(harness)
