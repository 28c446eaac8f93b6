"""Connector stats with several ranks, kvtier alone and inside vLLM's `MultiConnector`.

vLLM merges the workers' stats (`KVOutputAggregator`: `aggregate` across ranks) and
then adds the scheduler role's (`Scheduler.update_from_output`). kvtier's worker role
reports none: its counters are made once, by the scheduler role, from the workers'
merged transfer reports, so they do not grow with the ranks; byte counters are per rank.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import kvtier_harness, offload_worker
from multi_connector import MultiWorker, multi_harness
from vllm_harness import ConnectorWorker, VllmHarness, shared_prefix_prompts

from kvtier.adapters.vllm import KVTierConnector
from kvtier.adapters.vllm.stats import KVTierStats
from kvtier.transfer.worker import WorkerState

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
AGAIN = {f"again-{r}": [*p, 9] for r, p in PROMPTS.items()}


def kvtier_counters(harness: VllmHarness, batches: Sequence[Mapping[str, Sequence[int]]]) -> Any:
    """Run each batch of prompts until idle (the GPU cache reset between batches: the
    tier serves the later ones); return kvtier's stats counters summed over the steps'
    outputs, and the number of steps."""
    totals: collections.Counter[str] = collections.Counter()
    num_steps = 0
    for i, batch in enumerate(batches):
        if i:
            assert harness.scheduler.reset_prefix_cache()
        for request_id, prompt in batch.items():
            harness.add_request(request_id, prompt, 3)
        for record in busy_steps(harness):
            num_steps += 1
            for outputs in record.outputs.values():
                stats = outputs.scheduler_stats
                payload = stats.kv_connector_stats if stats is not None else None
                if payload is None:
                    continue
                if "counters" not in payload:  # MultiConnector's: by connector class name
                    payload = payload.get(KVTierConnector.__name__, {"counters": {}})
                totals.update(payload["counters"])
    harness.close()
    return totals, num_steps


@pytest.mark.parametrize(
    ("make", "num_ranks"),
    [(kvtier_harness, 1), (kvtier_harness, 2), (multi_harness, 1), (multi_harness, 2)],
    ids=["kvtier-1", "kvtier-2", "multi-1", "multi-2"],
)
def test_kvtiers_counters_are_counted_once_whatever_the_ranks(make: Any, num_ranks: int) -> None:
    totals, _ = kvtier_counters(make(num_ranks=num_ranks), [PROMPTS, AGAIN])
    # 4 prompts of 3 whole blocks stored; each 54-token prompt of the second batch is
    # served its 3 blocks (48 tokens) back from the tier.
    expected = {
        "stored_blocks": 12,
        "loaded_blocks": 12,
        "hit_tokens": 192,
        "tier_hit_tokens.CPU": 192,
        "bytes_stored": 12 * 4096,  # per rank: one block id is 4096 bytes on each
        "bytes_loaded": 12 * 4096,
        "transfer_bytes.GPU_to_CPU": 12 * 4096,
        "transfer_bytes.CPU_to_GPU": 12 * 4096,
    }
    assert {name: totals[name] for name in expected} == expected


def test_every_ranks_worker_stats_reach_the_scheduler_output_inside_a_multi_connector() -> None:
    """Regression (harness): `MultiWorker` dropped its children's worker-side stats, so
    with two ranks none reached vLLM's aggregator. kvtier's worker role stands in here
    for a child that reports some: one `tag_mismatches` per call, per rank."""
    harness = multi_harness(num_ranks=2)
    calls = collections.Counter[int]()
    for rank, worker in enumerate(harness.workers):
        assert isinstance(worker, MultiWorker)
        (kvtier,) = [c for c in worker.children if isinstance(c, ConnectorWorker)]

        def report(rank: int = rank) -> KVTierStats:
            calls[rank] += 1
            return KVTierStats(data={"counters": {"tag_mismatches": 1}})

        mock.patch.object(kvtier.connector, "get_kv_connector_stats", report).start()
    try:
        totals, num_steps = kvtier_counters(harness, [PROMPTS])
    finally:
        mock.patch.stopall()
    assert calls == {0: num_steps, 1: num_steps}
    assert totals["tag_mismatches"] == 2 * num_steps


def test_closing_a_multi_connector_harness_shuts_every_ranks_kvtier_worker_down() -> None:
    """Regression (harness): `VllmHarness.close` shut down a worker side's `connector`
    only, which `MultiWorker` has not: kvtier's workers inside it kept their tiers until
    garbage collection ("dropped without shutdown()")."""
    harness = multi_harness(num_ranks=2)
    harness.run_requests(PROMPTS, max_tokens=3)
    harness.close()
    assert [offload_worker(harness, rank).state for rank in (0, 1)] == [WorkerState.SHUT_DOWN] * 2
