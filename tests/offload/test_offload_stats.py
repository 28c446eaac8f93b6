"""What `take_stats` counts and `has_new_counts` sees (SPEC §6.10): hits, loads, stores, gauges."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

from sim import BYTES_PER_BLOCK, Admission, SimEngine, config, full_layout, make_request
from sim_worker import SECONDS_PER_BLOCK
from test_scenarios_cascade import cascade_engine, demotion_in_flight, keys_of, next_job

from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier
from kvtier.offload.transfers import FailedLoad


def loading_engine() -> SimEngine:
    """Return an engine whose tier holds "a" (8 tokens) and a request "b" admitted to load it."""
    engine = SimEngine(full_layout(), config())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    engine.scheduler.take_stats()
    assert engine.admit(make_request("b", [*range(8), 99])) == Admission(0, 8, 8)
    return engine


def test_hit_tokens_count_once_the_load_completed() -> None:
    """Accepted tokens are not hit tokens yet; they count when the load completes."""
    engine = loading_engine()
    (load,) = engine.step().jobs
    assert engine.scheduler.take_stats().hit_tokens == {"CPU": 0}
    assert not engine.scheduler.has_new_counts()
    engine.worker.complete(load.event_id)
    assert engine.poll().finished_loads == ("b",)
    assert engine.scheduler.has_new_counts()
    stats = engine.scheduler.take_stats()
    assert stats.hit_tokens == {"CPU": 8}
    assert stats.num_failed_loads == 0


def test_a_completed_load_counts_its_blocks_and_bytes() -> None:
    """SPEC §6.10: blocks loaded (and bytes moved) count when the load completes, not
    when it is issued; a failed load moves nothing worth counting."""
    engine = loading_engine()
    (load,) = engine.step().jobs
    assert engine.scheduler.take_stats().num_loaded_blocks == 0
    engine.worker.complete(load.event_id)
    engine.poll()
    stats = engine.scheduler.take_stats()
    assert (stats.num_loaded_blocks, stats.num_bytes_loaded) == (2, 2 * BYTES_PER_BLOCK)
    failing = loading_engine()
    (load,) = failing.step().jobs
    failing.worker.fail(load.event_id)
    failing.poll()
    assert failing.scheduler.take_stats().num_loaded_blocks == 0


def test_a_failed_load_counts_as_failed_and_serves_no_hit_tokens() -> None:
    """The engine recomputes a failed load's tokens: they are not hit tokens."""
    engine = loading_engine()
    (load,) = engine.step().jobs
    engine.worker.fail(load.event_id)
    assert engine.poll().failed_loads == (FailedLoad("b", 0, 8),)
    stats = engine.scheduler.take_stats()
    assert stats.num_failed_loads == 1
    assert stats.hit_tokens == {"CPU": 0}


def test_a_load_dropped_before_it_was_issued_counts_as_failed() -> None:
    """A reset drops a queued load; it comes back failed and is counted as such."""
    engine = loading_engine()
    assert engine.scheduler.reset() is True
    assert engine.poll().failed_loads == (FailedLoad("b", 0, 8),)
    stats = engine.scheduler.take_stats()
    assert stats.num_failed_loads == 1
    assert stats.hit_tokens == {"CPU": 0}


def test_accepting_more_than_offered_counts_a_failed_load() -> None:
    """A load refused at allocation (more tokens than the lookup pinned) counts as failed."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.scheduler.take_stats()
    b = make_request("b", [*range(12), 99])
    found = engine.lookup(b)
    assert engine.allocate(b, found, accept=12) == Admission(0, 8, 12)
    engine.step()
    assert engine.outcomes[-1].failed_loads == (FailedLoad("b", 0, 12),)
    assert engine.scheduler.take_stats().num_failed_loads == 1


def test_demotions_without_a_free_disk_slot_are_counted_as_dropped() -> None:
    """Write-through over a 2-slot disk: of 4 stored blocks, 2 demote and 2 are dropped."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=5, num_disk=3)
    store = engine.store_of_finished(make_request("a", range(16)))
    engine.worker.complete(store.event_id)
    engine.poll()
    stats = engine.scheduler.take_stats()
    assert (stats.num_stored_blocks, stats.num_dropped_demotions) == (4, 2)
    (demotion,) = engine.step().jobs
    assert (demotion.src_tier, demotion.dst_tier, len(demotion.src_block_ids)) == (
        Tier.CPU,
        Tier.DISK,
        2,
    )
    assert engine.scheduler.take_stats().num_dropped_demotions == 0


def test_stats_can_be_pickled_copied_and_logged() -> None:
    """`OffloadStats` leave the process (vLLM ships stats between processes) and get
    logged: every field is a plain value, the info labels a plain dict of strings."""
    stats = loading_engine().scheduler.take_stats()
    assert pickle.loads(pickle.dumps(stats)) == stats
    assert copy.deepcopy(stats) == stats
    json.dumps(dataclasses.asdict(stats))
    assert stats.info["store_mode"] == "eager"


def test_each_counter_alone_is_a_new_count_and_take_stats_clears_it() -> None:
    """`has_new_counts` (the vLLM adapter skips publishing without one) is True when any
    single counter moved: failed stores, hand-off outcomes, loaded blocks of a part of a
    load (its hit tokens come later); `take_stats` reports each count once."""
    stores = SimEngine(full_layout())
    stores.auto_complete = False
    stores.admit(make_request("a", range(8), outputs=[1]))
    stores.schedule("a")
    stores.step()
    stores.finish("a")
    (store,) = stores.step().jobs
    stores.handoff("gone", 0, 1)
    stores.step()
    stores.scheduler.take_stats()
    stores.worker.fail(store.event_id)
    stores.poll()
    assert stores.scheduler.has_new_counts()
    assert stores.scheduler.take_stats().num_failed_stores == 2
    assert not stores.scheduler.has_new_counts()
    stores.handoff("gone", 0, 1)
    stores.step()
    assert stores.scheduler.has_new_counts()
    assert stores.scheduler.take_stats().handoff_outcomes == {"dropped_request_gone": 1}
    assert stores.scheduler.take_stats().handoff_outcomes == {}

    loads = cascade_engine(CascadeMode.WRITE_THROUGH, num_cpu=4, num_disk=12)
    loads.run(make_request("a", range(12)))
    loads.drain()
    pool = loads.scheduler.tier_pool
    pool.discard_keys(pool.cached_block(keys_of(range(12), 1)[0]) or 0)  # block 0: disk only
    loads.evict_gpu()
    loads.auto_complete = False
    loads.admit(make_request("b", [*range(12), 5]))
    by_tier = {job.src_tier: job for job in loads.step().jobs if job.is_load}
    loads.scheduler.take_stats()
    loads.worker.complete(by_tier[Tier.CPU].event_id)
    assert loads.poll().finished_loads == ()
    assert loads.scheduler.has_new_counts()
    assert loads.scheduler.take_stats().num_loaded_blocks == 2


def test_a_failed_load_is_reported_by_one_take_stats_only() -> None:
    engine = loading_engine()
    (load,) = engine.step().jobs
    engine.worker.fail(load.event_id)
    engine.poll()
    assert engine.scheduler.take_stats().num_failed_loads == 1
    assert engine.scheduler.take_stats().num_failed_loads == 0


def test_blocks_pending_store_count_queued_and_in_flight_stores() -> None:
    """SPEC §6.10 gauge: blocks pending store are those selected but not issued yet
    (a finish flush waits for the next plan) plus those in flight."""
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    engine.admit(make_request("a", range(8)))
    engine.schedule("a")
    engine.step()
    engine.finish("a")  # queues blocks 0 and 1
    assert engine.scheduler.take_stats().num_blocks_pending_store == 2
    (store,) = engine.step().jobs
    assert engine.scheduler.take_stats().num_blocks_pending_store == 2
    engine.worker.complete(store.event_id)
    engine.poll()
    assert engine.scheduler.take_stats().num_blocks_pending_store == 0


def test_blocks_pending_store_count_a_cascades_demotions() -> None:
    """A cascade's demotions (CPU -> DISK copies) are blocks towards a tier too, queued
    and in flight, as `has_pending_stores` counts them. Regression: the gauge left them
    out and read 0 while a drain still waited for them."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    engine.auto_complete = False
    engine.admit(make_request("a", range(8)))
    engine.schedule("a")
    engine.step()
    engine.finish("a")  # queues blocks 0 and 1
    (store,) = engine.step().jobs
    engine.worker.complete(store.event_id)
    engine.poll()  # both in the CPU tier; write-through queues their demotions
    scheduler = engine.scheduler
    assert scheduler.has_pending_stores()
    assert scheduler.take_stats().num_blocks_pending_store == 2  # queued demotions
    demotion = next_job(engine, Tier.CPU, Tier.DISK)
    assert len(demotion.src_block_ids) == 2
    assert scheduler.take_stats().num_blocks_pending_store == 2  # in flight
    engine.worker.complete(demotion.event_id)
    engine.poll()
    assert not scheduler.has_pending_stores()
    assert scheduler.take_stats().num_blocks_pending_store == 0


def test_served_hit_tokens_are_new_counts_until_taken_once() -> None:
    engine = loading_engine()
    (load,) = engine.step().jobs
    engine.worker.complete(load.event_id)
    engine.poll()
    assert engine.scheduler.take_stats().hit_tokens == {"CPU": 8}
    assert not engine.scheduler.has_new_counts()  # the cumulative total did not move since


def test_stored_blocks_count_their_bytes() -> None:
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(8)))
    engine.drain()
    stats = engine.scheduler.take_stats()
    assert (stats.num_stored_blocks, stats.num_bytes_stored) == (2, 2 * BYTES_PER_BLOCK)
    assert stats.num_bytes_loaded == 0


def test_a_completed_demotion_alone_is_a_new_count() -> None:
    """The cascade's counters count as new: a report completing only demotions moves no
    store or load counter, yet `take_stats` has demoted blocks to report."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    store = engine.store_of_finished(make_request("a", range(8)))
    engine.worker.complete(store.event_id)
    engine.poll()
    (demotion,) = engine.step().jobs
    engine.scheduler.take_stats()
    engine.worker.complete(demotion.event_id)
    engine.poll()
    assert engine.scheduler.has_new_counts()
    assert engine.scheduler.take_stats().num_demoted_blocks == 2


def test_a_cascade_names_its_mode_and_disk_size_in_the_info_labels() -> None:
    info = cascade_engine(CascadeMode.WRITE_BACK, num_disk=9).scheduler.take_stats().info
    assert (info["cascade"], info["num_disk_blocks"]) == ("write_back", "9")
    assert info["disk_io_mode"] == "direct"
    cpu_only = SimEngine(full_layout()).scheduler.take_stats().info
    assert "cascade" not in cpu_only
    assert "disk_io_mode" not in cpu_only  # regression: a CPU tier named a disk I/O mode
    disk = OffloadConfig(disk_bytes=1 << 20, disk_path="unused", disk_io_mode=DiskIOMode.PAGE_CACHE)
    disk_only = SimEngine(full_layout(), disk, num_tier_blocks=9).scheduler.take_stats().info
    assert "cascade" not in disk_only
    assert disk_only["disk_io_mode"] == "page_cache"  # a mutant named it only with a cascade


def test_transfers_count_bytes_and_copy_time_per_direction() -> None:
    """SPEC §6.10 Beyond: bytes moved and transfer time per direction (vLLM's labels),
    counted when a transfer completed on every worker; a failed one counts neither."""
    engine = loading_engine()  # "a" stored (2 blocks), "b" admitted to load them
    (load,) = engine.step().jobs
    engine.worker.complete(load.event_id)
    engine.poll()
    stats = engine.scheduler.take_stats()
    assert stats.transfer_bytes == {"CPU_to_GPU": 2 * BYTES_PER_BLOCK}
    assert stats.transfer_seconds == {"CPU_to_GPU": 2 * SECONDS_PER_BLOCK}
    stored = SimEngine(full_layout(), config())
    stored.run(make_request("a", range(8)))
    stored.drain()
    totals = stored.scheduler.take_stats()
    assert totals.transfer_bytes == {"GPU_to_CPU": 2 * BYTES_PER_BLOCK}
    assert totals.transfer_seconds == {"GPU_to_CPU": 2 * SECONDS_PER_BLOCK}

    failing = loading_engine()
    (load,) = failing.step().jobs
    failing.worker.fail(load.event_id)
    failing.poll()
    stats = failing.scheduler.take_stats()
    assert (stats.transfer_bytes, stats.transfer_seconds) == ({}, {})


def test_a_demotion_counts_as_cpu_to_disk() -> None:
    engine = cascade_engine(CascadeMode.WRITE_THROUGH)
    engine.run(make_request("a", range(8)))
    engine.drain()
    seen: dict[str, int] = {}
    for _ in range(3):
        engine.step()
        seen.update(engine.scheduler.take_stats().transfer_bytes)
    engine.drain()
    seen.update(engine.scheduler.take_stats().transfer_bytes)
    assert seen.get("CPU_to_DISK") == 2 * BYTES_PER_BLOCK


def test_an_event_takes_its_slowest_workers_time() -> None:
    """Two workers report one store at different steps: the event's time is the larger."""
    engine = SimEngine(full_layout(), config(), num_workers=2)
    store = engine.store_of_finished(make_request("a", range(8)))
    engine.worker.complete(store.event_id, [0])
    engine.scheduler.apply_report(
        dataclasses.replace(engine.worker.take_report(), seconds={store.event_id: 0.5})
    )
    assert engine.scheduler.take_stats().transfer_seconds == {}  # one worker of two
    engine.worker.complete(store.event_id, [1])
    engine.scheduler.apply_report(
        dataclasses.replace(engine.worker.take_report(), seconds={store.event_id: 0.2})
    )
    assert engine.scheduler.take_stats().transfer_seconds == {"GPU_to_CPU": 0.5}


def test_a_copy_that_registers_nothing_is_still_a_new_count() -> None:
    """A demotion every worker copied, of a CPU block whose keys a failed load dropped
    meanwhile, registers nothing and counts no demoted block: its bytes and copy time
    alone are this step's counts (a mutant's `has_new_counts` ignored them, and an
    adapter skipping the publish would have lost them)."""
    engine, demotion = demotion_in_flight()
    cascade = engine.scheduler.cascade
    assert cascade is not None
    for block_id in demotion.src_block_ids:  # as a failed load of them does
        cascade.before_cpu_discard(block_id)
        cascade.cpu_pool.discard_keys(block_id)
    engine.scheduler.take_stats()
    engine.worker.complete(demotion.event_id)
    engine.poll()
    assert engine.scheduler.has_new_counts()
    stats = engine.scheduler.take_stats()
    assert stats.num_demoted_blocks == 0
    assert stats.transfer_bytes == {"CPU_to_DISK": 2 * BYTES_PER_BLOCK}
    engine.check()


def test_a_failed_demotion_alone_is_a_new_count() -> None:
    """A failed demotion counts only in the cascade's counters (a mutant's
    `has_new_counts` ignored those)."""
    engine, demotion = demotion_in_flight()
    engine.scheduler.take_stats()
    engine.worker.fail(demotion.event_id)
    engine.poll()
    assert engine.scheduler.has_new_counts()
    assert engine.scheduler.take_stats().num_failed_demotions == 2
    assert not engine.scheduler.has_new_counts()
    engine.check()


def test_a_failed_load_alone_is_a_new_count() -> None:
    """A load whose copy failed counts no loaded block, no bytes and no hit tokens: its
    failure is the step's only count (a mutant's `has_new_counts` ignored it)."""
    engine = SimEngine(full_layout())
    engine.run(make_request("a", range(9)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", range(9))) == Admission(0, 8, 8)
    (load,) = engine.step().jobs
    engine.scheduler.take_stats()
    engine.worker.fail(load.event_id)
    engine.poll()
    assert engine.scheduler.has_new_counts()
    assert engine.scheduler.take_stats().num_failed_loads == 1
    engine.check()
