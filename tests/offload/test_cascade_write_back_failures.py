"""Write-back demotions into a failing disk: given up, never retried in a loop, so drains end.

Regression: with every CPU → DISK write failing (full disk, EIO, read-only), each plan
demoted the CPU tier's next victims again; a failed block went back to the CPU free
queue's MRU end and the next victims were tried, with no memory of the failure. An idle
engine issued and failed a demotion every step, and since `has_pending_stores()` counted
them, a drain (`LLM.drain()`, `shutdown()`) never finished when each failure was reported
one poll late (a legal asynchronous worker).
"""

from __future__ import annotations

from sim import SimEngine, make_request
from test_cascade_demotions import WB, cache, key, make
from test_scenarios_cascade import cascade_engine, holds, keys_of

from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier


class FailingDisk:
    """Drive a SimEngine whose disk fails every demotion, each reported one step late;
    GPU ↔ CPU jobs complete in the step that issued them."""

    def __init__(self, engine: SimEngine) -> None:
        engine.auto_complete = False
        self.engine = engine
        self.late: list[int] = []
        self.num_demoted = 0  # blocks of the demotions issued

    def step(self) -> None:
        engine = self.engine
        for event_id in self.late:
            engine.worker.fail(event_id)
        plan = engine.step()
        self.late = [job.event_id for job in plan.jobs if job.dst_tier is Tier.DISK]
        self.num_demoted += sum(job.num_blocks for job in plan.jobs if job.dst_tier is Tier.DISK)
        for job in plan.jobs:
            if job.event_id not in self.late:
                engine.worker.complete(job.event_id)
        engine.poll()

    def run(self, request_id: str, tokens: range) -> None:
        """Run a request to its end and finish it; its store completes."""
        engine = self.engine
        assert engine.admit(make_request(request_id, tokens)) is not None
        engine.schedule(request_id)
        self.step()
        engine.finish(request_id)
        self.step()


def failing_write_back() -> tuple[SimEngine, FailingDisk]:
    """Return a write-back cascade (8 usable CPU blocks, reserve 2) whose CPU tier holds
    8 cached blocks (no unhashed victim comes first), every demotion so far failed."""
    engine = cascade_engine(CascadeMode.WRITE_BACK, num_cpu=9, num_disk=12)
    disk = FailingDisk(engine)
    for i in range(4):
        disk.run(f"r{i}", range(100 * i, 100 * i + 8))  # 2 blocks each
    return engine, disk


def test_an_idle_engine_stops_demoting_into_a_failing_disk_and_drains() -> None:
    engine, disk = failing_write_back()
    for _ in range(50):
        disk.step()
    assert disk.num_demoted <= 8, "a failed demotion was tried again"  # 8 cached blocks
    assert not engine.worker.in_flight
    assert not engine.scheduler.has_pending_stores()
    stats = engine.scheduler.take_stats()
    assert stats.num_failed_demotions == disk.num_demoted
    assert stats.num_demoted_blocks == 0
    for i in range(4):  # the CPU copies stay and still hit
        for k in keys_of(range(100 * i, 100 * i + 8), 2):
            assert holds(engine, Tier.CPU, k)
    engine.check()


def test_a_drain_waits_for_write_back_demotions_in_flight_and_ends() -> None:
    """A drain waits for the demotions in flight (their reports free the slots they pin:
    an idle vLLM would otherwise fail a reset until its next request), and ends once
    every victim failed once."""
    engine, disk = failing_write_back()
    disk.step()
    assert engine.worker.in_flight
    assert engine.scheduler.has_pending_stores()
    steps = 0
    while engine.scheduler.has_pending_stores():
        assert steps < 10, "the drain never ends"
        disk.step()
        steps += 1
    assert not engine.worker.in_flight
    assert engine.scheduler.reset()
    engine.check()


def test_failed_blocks_evicted_later_count_as_lost() -> None:
    engine, disk = failing_write_back()
    for _ in range(10):
        disk.step()
    engine.scheduler.take_stats()
    disk.run("big", range(1000, 1024))  # 6 blocks: evicts the failed ones
    assert engine.scheduler.take_stats().num_lost_blocks > 0
    engine.check()


# ------------------------------------------------------------ Cascade on its own


def test_a_failed_write_back_victim_is_not_demoted_again() -> None:
    """A failed (CPU block, key) pair is remembered: each victim fails at most once, and
    once every victim in the window has failed, nothing is demoted."""
    cpu, _, cascade = make(WB, reserve=2)
    cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    tried: list[bytes] = []
    for _ in range(3 * cpu.num_usable_blocks):
        cascade.select_write_back()
        items = cascade.take_queued()
        tried += [item.key for item in items]
        cascade.complete(items, succeeded=False, abandoned=False)
    assert sorted(tried) == sorted(key(i) for i in range(cpu.num_usable_blocks))
    counters = cascade.take_counters()
    assert counters.num_failed_demotions == cpu.num_usable_blocks
    assert len(cascade.failed) == cpu.num_usable_blocks
    cpu.check_invariants()


def test_a_failed_victim_is_retried_once_a_demotion_succeeds() -> None:
    """A successful demotion shows the disk works again: the failures are forgotten, and
    the blocks are demoted when they are among the next victims again."""
    cpu, disk, cascade = make(WB, reserve=2)
    cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    cascade.select_write_back()
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)  # keys 0, 1
    assert {k for _, k in cascade.failed} == {key(0), key(1)}
    held: list[int] = []
    for expected in ([2, 3], [4, 5], [6, 7], [1, 0]):  # failed ones went to the MRU end
        cascade.select_write_back()
        items = cascade.take_queued()
        assert [item.key for item in items] == [key(i) for i in expected]
        cascade.complete(items, succeeded=True, abandoned=False)
        assert cascade.failed == set()
        held += cpu.allocate(2)  # the demoted blocks left the CPU tier: reuse them
    assert all(disk.cached_block(key(i)) is not None for i in range(8))
    cpu.free(held)
    cpu.check_invariants()


def test_a_failed_block_with_new_content_is_demoted() -> None:
    """The memory is per (block, key): an evicted block forgets its failure, and its next
    content is demoted like any other."""
    cpu, _, cascade = make(WB, reserve=1)
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    cascade.select_write_back()
    cascade.complete(cascade.take_queued(), succeeded=False, abandoned=False)
    assert cascade.failed == {(blocks[0], key(0))}
    cpu.allocate(cpu.num_usable_blocks)  # evicts every block, none on disk
    assert cascade.failed == set()
    assert cascade.take_counters().num_lost_blocks == cpu.num_usable_blocks
    cpu.insert_key(key(8), blocks[0], 16)
    cpu.free([blocks[0]])
    cascade.select_write_back()
    assert [item.key for item in cascade.take_queued()] == [key(8)]
