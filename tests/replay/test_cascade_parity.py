"""The replay's write-through cascade is exactly what `OffloadScheduler` does.

Drives the real scheduler with a CPU + DISK cascade (`OffloadConfig.cascade`
write_through; eager stores, a GPU pool, a worker finishing every event at once) over
small traces, and checks that every request hits as many blocks in each tier as
`TierReplay` with `cascade=write_through` (release order `scheduler_tail_first`), that
both count the same stores into the CPU tier and copies to DISK, and that both tiers
end up holding the same keys.

They agree when the scheduler's demotions keep up, that is when each request's
demotions have landed before the next request's lookup: here every step's events
finish at once and a step with nothing scheduled follows each request (the copies
that its store completion queued are issued and finish there). The request's loaded
blocks count as computed only with the rest of its prompt (the engine confirms them
in the step that computes it), so their stores into the CPU (promotions) go in the
same batch as the computed blocks', as the replay stores them. In the scheduler a
block copied to DISK stays pinned in the CPU tier until its copy lands, so it is
freed after the stored blocks DISK already held; the replay releases them in that
order (regression: it released them in one batch, and e.g. the doc trace below with
11 CPU and 29 DISK blocks hit the CPU 65 times instead of the scheduler's 56). The DISK
loads land before the stores, so a promoted block's DISK copy is free when its store's
demotion finds it there; neither refreshes it (the load counted the request's use),
which S3-FIFO (frequency bit) and LFU-DA (count) would tell from one touch (regression:
the scheduler alone touching it again failed 7 of these runs, s3fifo, lfuda and duel).

Write-back has no such test: the scheduler demotes the next `reserve` victims of the
CPU tier at each plan (ahead of need, or too few for a burst of stores: docs/policies.md),
checking DISK for a whole batch before allocating its slots, while the replay demotes
each victim as its slot is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from replay_helpers import BLOCK, chat_trace, doc_trace
from test_scheduler_parity import _complete, trace_request

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.policies import PolicySpec
from kvtier.offload.config import CascadeMode as OffloadCascadeMode
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.replay.config import CascadeMode, ReleaseOrder, ReplayConfig, TierConfig
from kvtier.replay.tier_replay import TierReplay
from kvtier.replay.trace import TraceRecord

BYTES_PER_BLOCK = 64
POLICIES = ["lru", "lru+door", "arc", "s3fifo", "lfuda", "duel"]

Result = tuple[list[tuple[int, int]], set[Key], set[Key], tuple[int, int]]


def _keys(pool: BlockPool) -> set[Key]:
    return {k for b in range(1, pool.num_blocks) if (k := pool.key(b)) is not None}


def _plan(scheduler: OffloadScheduler, step: StepInput, counts: list[int]) -> None:
    """Build a plan, finish every event, add the stores and demotions it registered."""
    _complete(scheduler, scheduler.build_plan(step))
    stats = scheduler.take_stats()
    counts[0] += stats.num_stored_blocks
    counts[1] += stats.num_demoted_blocks


def _drive_scheduler(
    records: Sequence[TraceRecord], policy: str, num_cpu: int, num_disk: int
) -> Result:
    layout = KVLayout.single(BLOCK, BYTES_PER_BLOCK)
    spec = PolicySpec.parse(policy)
    config = OffloadConfig(
        cpu_bytes=num_cpu * BYTES_PER_BLOCK,
        disk_bytes=num_disk * BYTES_PER_BLOCK,
        disk_path="unused",  # the scheduler never opens it
        num_blocks=num_cpu,
        cascade=OffloadCascadeMode.WRITE_THROUGH,
        eviction_policy=spec.eviction,
        admission_policy=spec.admission,
    )
    scheduler = OffloadScheduler(config, SchedulerSetup(layout, num_cpu, num_disk_blocks=num_disk))
    assert scheduler.cascade is not None
    gpu = BlockPool(1 + 2 * max(len(r.hash_ids) for r in records))
    scheduler.bind_gpu_pool(gpu)
    hits = []
    counts = [0, 0]  # stored into the CPU tier, copied to DISK
    for i, record in enumerate(records):
        n = len(record.hash_ids)
        request, hashes = trace_request(i, record.hash_ids)
        external = scheduler.lookup(request, 0)
        table = gpu.allocate(n)
        served = scheduler.on_allocated(request, [table], external)
        hits.append((served.get(Tier.CPU, 0) // BLOCK, served.get(Tier.DISK, 0) // BLOCK))
        scheduled = ScheduledRequest(request, (tuple(table),), n * BLOCK, TableUpdate.REPLACE)
        _plan(scheduler, StepInput(scheduled=(scheduled,)), counts)
        for j, block_id in enumerate(table):  # loaded and computed blocks, hashed now
            gpu.insert_key(make_key(hashes[j], 0), block_id, BLOCK)
        request.num_computed_tokens = n * BLOCK
        scheduler.on_finished(request, [table])
        _plan(scheduler, StepInput(finished_request_ids=frozenset({request.request_id})), counts)
        _plan(scheduler, StepInput(), counts)  # the demotions queued by the stores land
        gpu.free(table[::-1])
        scheduler.check_invariants()
    assert not scheduler.cascade.queued
    assert not scheduler.cascade.in_flight_keys
    cpu, disk = _keys(scheduler.tier_pool), _keys(scheduler.cascade.disk_pool)
    return hits, cpu, disk, (counts[0], counts[1])


def _drive_replay(
    records: Sequence[TraceRecord], policy: str, num_cpu: int, num_disk: int
) -> Result:
    config = ReplayConfig(
        tiers=(
            TierConfig("CPU", (num_cpu - 1) * BLOCK, 25.0),
            TierConfig("DISK", (num_disk - 1) * BLOCK, 5.0),
        ),
        policy=policy,
        block_size=BLOCK,
        release_order=ReleaseOrder.SCHEDULER_TAIL_FIRST,
        cascade=CascadeMode.WRITE_THROUGH,
    )
    replay = TierReplay(records, config)
    cpu, disk = replay.tiers
    hits = []
    for _ in records:
        before = cpu.hit_blocks, disk.hit_blocks
        replay.step()
        hits.append((cpu.hit_blocks - before[0], disk.hit_blocks - before[1]))
    assert cpu.demoted == disk.stored
    return hits, _keys(cpu.pool), _keys(disk.pool), (cpu.stored, cpu.demoted)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("trace", "num_cpu", "num_disk"),
    [("chat", 12, 30), ("chat", 25, 60), ("chat", 40, 100), ("doc", 12, 30), ("doc", 25, 60)],
)
def test_write_through_replay_matches_the_real_scheduler(
    policy: str, trace: str, num_cpu: int, num_disk: int
) -> None:
    records = chat_trace(seed=1) if trace == "chat" else doc_trace(seed=2)
    expected = _drive_scheduler(records, policy, num_cpu, num_disk)
    got = _drive_replay(records, policy, num_cpu, num_disk)
    assert sum(d for _, d in expected[0]) > 0, "the trace must exercise DISK hits"
    assert got[0] == expected[0]
    assert got[1:] == expected[1:]
