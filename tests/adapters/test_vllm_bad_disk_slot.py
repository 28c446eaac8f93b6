"""A corrupted disk slot through vLLM: only the request that reads it fails (SPEC §6.8).

Two requests load their prefixes from the disk tier in one step, as one DISK -> GPU event;
one rank finds one slot of it corrupted. That rank names the bad slot and reports both
requests finished, with the one GPU block the bad slot was copied into as a load error
(one full-attention group: `test_vllm_partial_load_failure`), and no request in
`failed_recving`; the scheduler, from the ranks' merged report, fails the same request
and drops only that slot's key.
Regression: the whole event failed, so vLLM recomputed both requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SLOT_BYTES,
    check_quiescent,
    drain,
    kvtier_harness,
    kvtier_worker,
    offload_worker,
    scheduler_side,
)
from test_vllm_partial_load_failure import CorruptSlot
from vllm_harness import shared_prefix_prompts

PREFIX = 64  # tokens per request's prefix


def record_failed(harness: Any, rank: int, into: set[str], invalid: set[int]) -> None:
    """Collect what one rank's worker side reports in `failed_recving` and as load
    errors (`get_block_ids_with_load_errors`)."""
    side = kvtier_worker(harness, rank).connector.worker_side  # type: ignore[attr-defined]
    take, take_invalid = side.take_results, side.take_invalid_blocks

    def take_results() -> tuple[set[str], set[str]]:
        finished, failed = take()
        into.update(failed)
        return finished, failed

    def take_invalid_blocks() -> set[int]:
        blocks = take_invalid()
        invalid.update(blocks)
        return blocks

    side.take_results = take_results
    side.take_invalid_blocks = take_invalid_blocks


def stored_and_evicted(harness: Any) -> dict[str, list[int]]:
    """Serve two requests with distinct prefixes, drain their stores, then drop vLLM's
    GPU copies (prefix cache reset, caches zeroed); return their prompts."""
    prompts = shared_prefix_prompts(2, prefix_len=PREFIX, suffix_len=8, num_prefixes=2)
    harness.run_requests(prompts, max_tokens=3)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    for cache in harness.caches:
        cache.raw.zero_()
    return prompts


def record_recomputed(harness: Any) -> list[str]:
    """Return a list kvtier's scheduler adds each failed load's request to (recomputed)."""
    side = scheduler_side(harness)
    apply = side.offload.apply_report
    recomputed: list[str] = []

    def apply_report(report: Any) -> Any:
        outcome = apply(report)
        recomputed.extend(f.request_id for f in outcome.failed_loads)
        return outcome

    side.offload.apply_report = apply_report
    return recomputed


def serve_again(harness: Any, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Serve each prompt again with one more token, until done; return the new prompts.

    The harness checks every loaded block's content (never wrong KV).
    """
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    for request_id, prompt in again.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    drain(harness)
    assert harness.finished >= set(again)
    return again


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_corrupted_slot_fails_only_the_request_that_reads_it(
    tmp_path: Path, num_ranks: int, which: int
) -> None:
    extra = {"cpu_bytes": 0, "disk_bytes": 256 * SLOT_BYTES, "disk_path": str(tmp_path)}
    extra["disk_io_mode"] = "page_cache"
    harness = kvtier_harness(extra=extra, num_ranks=num_ranks)
    prompts = stored_and_evicted(harness)
    last = num_ranks - 1
    corrupt = CorruptSlot(offload_worker(harness, rank=last), which)
    reported: set[str] = set()
    invalid: set[int] = set()
    for rank in range(num_ranks):
        record_failed(harness, rank, reported, invalid)
    recomputed = record_recomputed(harness)
    again = serve_again(harness, prompts)
    assert corrupt.slot is not None, "the two prefixes never loaded in one event"
    bad = corrupt.request_ids[which]
    assert reported == set()  # vLLM's failed_recving, over the ranks
    assert len(invalid) == 1  # the bad slot's GPU block: vLLM recomputes from there
    assert recomputed == [bad]  # kvtier's own view agrees
    assert all(harness.external_hit_tokens(r) == PREFIX for r in again)  # offered
    check_quiescent(harness)
