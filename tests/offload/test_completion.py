"""What applying a completed transfer releases and reports (`offload/completion.py`).

Pins are released tail first, so a prefix's tail is evicted before its root (SPEC §4);
a failed load is reported once, whole unless every failure of it named its bad blocks;
its suspect copies leave every record that would serve or restore them (SPEC §6.8).
"""

from __future__ import annotations

from typing import Any

import pytest
from sim import SimEngine, block_key, full_layout, make_request
from test_dropped_slots import disk_only
from test_scenarios_cascade import cascade_engine, holds, keys_of
from test_scenarios_lifecycle import loading_engine

from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier, TransferJob, WorkerReport
from kvtier.offload.transfers import FailedLoad, ReportOutcome


def prefix_keys(num_blocks: int) -> list[bytes]:
    """Return the keys of the first `num_blocks` 4-token blocks of tokens 0, 1, ..."""
    request = make_request("k", range(4 * num_blocks))
    return [block_key(full_layout(), request, 0, i) for i in range(num_blocks)]


def load_of_a_into_b(engine: SimEngine, tier: Tier) -> TransferJob:
    """Store a's two blocks, evict them from the GPU, admit b sharing them: return b's
    load from `tier`, not completed (`auto_complete` off)."""
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(8), 99])) is not None
    (load,) = engine.step().jobs
    assert load.src_tier is tier
    return load


def test_a_completed_load_frees_its_tier_blocks_tail_first() -> None:
    """SPEC §4: once b's load of a's two blocks completes, the tier evicts the tail
    block before the root, so a shorter prefix still hits (head first, the root went
    first and the tail it keeps serves no lookup)."""
    engine = SimEngine(full_layout(), num_tier_blocks=3)  # two usable tier blocks
    load = load_of_a_into_b(engine, Tier.CPU)
    engine.worker.complete(load.event_id)
    assert engine.poll().finished_loads == ("b",)
    engine.auto_complete = True
    engine.run(make_request("c", [*range(100, 104), 7]))  # its one block evicts one of a's
    engine.drain()
    root, tail = prefix_keys(2)
    assert holds(engine, Tier.CPU, root)
    assert not holds(engine, Tier.CPU, tail)
    engine.check()


def test_a_completed_store_frees_its_gpu_sources_tail_first() -> None:
    """SPEC §4: a's store, completed after a finished, holds the last references on its
    GPU blocks; released tail first, the GPU pool reuses the tail block before the root."""
    engine = SimEngine(full_layout())
    store = engine.store_of_finished(make_request("a", range(8)))
    assert store.num_blocks == 2
    engine.worker.complete(store.event_id)
    engine.poll()
    root, tail = prefix_keys(2)
    assert engine.gpu.cached_block(root) is not None
    assert engine.gpu.cached_block(tail) is not None
    taken = engine.gpu.allocate(engine.gpu.num_free() - 1)  # every block but one cached
    assert engine.gpu.cached_block(root) is not None
    assert engine.gpu.cached_block(tail) is None
    engine.gpu.free(taken)
    engine.check()


def split_load(engine: SimEngine) -> dict[Tier, TransferJob]:
    """Store a's 12 tokens in both tiers, drop the first block's CPU copy and admit b:
    return b's load jobs by source tier (DISK: block 0; CPU: blocks 1 and 2)."""
    engine.run(make_request("a", range(12)))
    engine.drain()
    first = keys_of(range(12), 3)[0]
    engine.scheduler.tier_pool.discard_keys(engine.scheduler.tier_pool.cached_block(first) or 0)
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(12), 5])) is not None
    jobs = {job.src_tier: job for job in engine.step().jobs if job.is_load}
    assert set(jobs) == {Tier.CPU, Tier.DISK}
    return jobs


@pytest.mark.parametrize("named_first", [False, True], ids=["whole-first", "named-first"])
def test_a_load_with_a_part_failed_unnamed_fails_whole(named_first: bool) -> None:
    """`FailedLoad.whole`: one failed part that named no bad block makes the whole load
    suspect, whichever part completes first; a later part whose workers named its bad
    block does not make it partial again."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    jobs = split_load(engine)
    cpu, disk = jobs[Tier.CPU], jobs[Tier.DISK]
    named = WorkerReport(
        failed={cpu.event_id: 1}, bad_blocks={cpu.event_id: frozenset({cpu.src_block_ids[0]})}
    )
    unnamed = WorkerReport(failed={disk.event_id: 1})
    reports = [named, unnamed] if named_first else [unnamed, named]
    assert engine.scheduler.apply_report(reports[0]) == ReportOutcome()  # a part pending
    (failure,) = engine.scheduler.apply_report(reports[1]).failed_loads
    assert failure == FailedLoad("b", 0, 12)
    assert failure.whole
    engine.worker.in_flight.clear()
    engine.check()


def test_a_failed_cpu_load_forgets_the_demotion_its_suspect_blocks_waited_for() -> None:
    """A write-through demotion dropped for want of a disk slot waits among the retries;
    a failed load of its CPU block discards the block's keys, and the retry goes with
    them (`Cascade.before_cpu_discard`): the pair must not outlive its key, as a
    demotion still owed (`check_invariants` names such a stale pair)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=5, num_disk=2)
    engine.run(make_request("a", range(8)))
    engine.drain()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    assert cascade.retry, "the test needs a demotion waiting for a disk slot"
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(8), 5])) is not None
    (load,) = [job for job in engine.step().jobs if job.is_load]
    assert load.src_tier is Tier.CPU
    assert {block_id for block_id, _ in cascade.retry} <= set(load.src_block_ids)
    engine.worker.fail(load.event_id)
    assert [f.request_id for f in engine.poll().failed_loads] == ["b"]
    assert not cascade.retry
    assert not cascade.dropped
    engine.check()


def test_a_failed_load_of_a_persistent_disk_names_its_slots_for_the_manifest() -> None:
    """A failed load's suspect disk copies lose their keys, and their manifest records
    go with the next plan (`forget_slots`): a restart must not restore them."""
    engine = disk_only(persist=True)
    load = load_of_a_into_b(engine, Tier.DISK)
    engine.worker.fail(load.event_id)
    assert [f.request_id for f in engine.poll().failed_loads] == ["b"]
    assert set(load.src_block_ids) <= set(engine.step().forget_slots)
    engine.check()


def interrupt_after_noting(engine: SimEngine) -> list[bool]:
    """Make the scheduler's next noting of a load that finished or failed raise
    KeyboardInterrupt once, right after it noted it; return the list it marks then."""
    completion: Any = engine.scheduler._completion
    note_done = completion._note_done
    interrupted: list[bool] = []

    def noting(progress: Any) -> None:
        note_done(progress)
        if progress.num_pending == 0 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    completion._note_done = noting
    return interrupted


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_a_load_noted_by_an_apply_cut_short_is_reported_once(fails: bool) -> None:
    """`TransferCompletion.apply` is safe to cut short and repeat: a Ctrl-C right after
    it noted b's load as finished (or failed) leaves the step to the next call, which
    reports b once, counting its hit tokens (or its failure) once."""
    engine, _ = loading_engine()
    (load,) = engine.step().jobs
    interrupted = interrupt_after_noting(engine)
    event = load.event_id
    report = WorkerReport(failed={event: 1}) if fails else WorkerReport(done={event: 1})
    with pytest.raises(KeyboardInterrupt):
        engine.scheduler.apply_report(report)
    assert interrupted
    outcome = engine.scheduler.apply_report(WorkerReport())
    stats = engine.scheduler.take_stats()
    if fails:
        assert outcome.failed_loads == (FailedLoad("b", 0, 8),)
        assert outcome.finished_loads == ()
        assert stats.num_failed_loads == 1
    else:
        assert outcome.finished_loads == ("b",)
        assert outcome.failed_loads == ()
        assert stats.hit_tokens == {Tier.CPU.value: 8}
    engine.worker.in_flight.clear()
    engine.check()
