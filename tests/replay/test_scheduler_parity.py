"""The replay's SCHEDULER_TAIL_FIRST release order is exactly what `OffloadScheduler` does.

Drives the real scheduler (eager stores, a GPU pool, a worker that finishes every event
at once) over small traces, configured with each eviction and admission policy
(`OffloadConfig.eviction_policy` / `admission_policy`), and checks that every request
hits exactly as many tier blocks as in `TierReplay`, and that both tiers end up holding
the same keys. The scheduler's lookup pins a request's hits tail first, and so does the
replay in this order: `duel`'s shadow caches see the hits in the order they are pinned
(regression: the replay pinned them root first, and duel on the chat trace with 25
blocks hit differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from replay_helpers import BLOCK, chat_trace, doc_trace

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.policies import EVICTION_POLICIES, PolicySpec
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import TransferPlan, WorkerReport
from kvtier.offload.protocols import LoRAInfo, ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.replay.tier_replay import ReleaseOrder, ReplayConfig, TierConfig, TierReplay
from kvtier.replay.trace import TraceRecord

BYTES_PER_BLOCK = 64
POLICIES = [*sorted(EVICTION_POLICIES), "lru+door", "lfuda+door"]


@dataclass
class _Request:
    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: tuple[bytes, ...]
    num_output_placeholders: int = 0
    token_ids: tuple[int, ...] = ()
    lora: LoRAInfo | None = None
    skip_prefix_cache: bool = False
    session_id: str | None = None

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        return ()

    def blocks_extra_keys(self, block_size: int, count: int) -> list[tuple[object, ...]]:
        return [()] * count


def trace_request(index: int, hash_ids: Sequence[int]) -> tuple[_Request, tuple[bytes, ...]]:
    """Return request `r{index}` of a trace record's blocks, and its block hashes."""
    hashes = tuple(h.to_bytes(8, "little") for h in hash_ids)
    # Every trace block is a full hash block here; +1 so the last-token cap never bites.
    num_tokens = len(hash_ids) * BLOCK + 1
    return _Request(f"r{index}", num_tokens, num_tokens, 0, hashes), hashes


def _complete(scheduler: OffloadScheduler, plan: TransferPlan) -> None:
    scheduler.apply_report(WorkerReport(done={job.event_id: 1 for job in plan.jobs}))


def _drive_scheduler(
    records: Sequence[TraceRecord], policy: str, num_tier_blocks: int
) -> tuple[list[int], set[Key]]:
    layout = KVLayout.single(BLOCK, BYTES_PER_BLOCK)
    spec = PolicySpec.parse(policy)
    config = OffloadConfig(
        cpu_bytes=num_tier_blocks * BYTES_PER_BLOCK,
        num_blocks=num_tier_blocks,
        eviction_policy=spec.eviction,
        admission_policy=spec.admission,
    )
    scheduler = OffloadScheduler(config, SchedulerSetup(layout, num_tier_blocks))
    gpu = BlockPool(1 + 2 * max(len(r.hash_ids) for r in records))
    scheduler.bind_gpu_pool(gpu)
    hits = []
    for i, record in enumerate(records):
        n = len(record.hash_ids)
        request, hashes = trace_request(i, record.hash_ids)
        external = scheduler.lookup(request, 0)
        table = gpu.allocate(n)
        request.num_computed_tokens = external
        scheduler.on_allocated(request, [table], external)
        scheduled = ScheduledRequest(request, (tuple(table),), n * BLOCK, TableUpdate.REPLACE)
        _complete(scheduler, scheduler.build_plan(StepInput(scheduled=(scheduled,))))
        for j, block_id in enumerate(table):  # the forward pass computed every block
            gpu.insert_key(make_key(hashes[j], 0), block_id, BLOCK)
        request.num_computed_tokens = n * BLOCK
        scheduler.on_finished(request, [table])
        finished = StepInput(finished_request_ids=frozenset({request.request_id}))
        _complete(scheduler, scheduler.build_plan(finished))
        gpu.free(table[::-1])
        scheduler.check_invariants()
        hits.append(external // BLOCK)
    pool = scheduler.tier_pool
    keys = {k for b in range(1, pool.num_blocks) if (k := pool.key(b)) is not None}
    return hits, keys


def _drive_replay(
    records: Sequence[TraceRecord], policy: str, num_tier_blocks: int
) -> tuple[list[int], set[Key]]:
    tier = TierConfig("CPU", (num_tier_blocks - 1) * BLOCK, 25.0)
    config = ReplayConfig(
        tiers=(tier,),
        policy=policy,
        block_size=BLOCK,
        release_order=ReleaseOrder.SCHEDULER_TAIL_FIRST,
    )
    replay = TierReplay(records, config)
    hits = []
    for _ in records:
        before = replay.tiers[0].hit_blocks
        replay.step()
        hits.append(replay.tiers[0].hit_blocks - before)
    pool = replay.tiers[0].pool
    keys = {k for b in range(1, pool.num_blocks) if (k := pool.key(b)) is not None}
    return hits, keys


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("trace", "num_tier_blocks"), [("chat", 12), ("chat", 25), ("chat", 40), ("doc", 25)]
)
def test_replay_matches_the_real_scheduler(policy: str, trace: str, num_tier_blocks: int) -> None:
    records = chat_trace(seed=1) if trace == "chat" else doc_trace(seed=2)
    expected_hits, expected_keys = _drive_scheduler(records, policy, num_tier_blocks)
    hits, keys = _drive_replay(records, policy, num_tier_blocks)
    assert sum(expected_hits) > 0, "the trace must exercise hits"
    assert hits == expected_hits
    assert keys == expected_keys
