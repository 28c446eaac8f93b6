"""Store selection rules and their outcome counts that no scenario pins (SPEC §6.5-§6.7, §6.10)."""

from __future__ import annotations

import hashlib

import pytest
from sim import SimEngine, block_key, config, full_layout, make_request
from test_scenarios_config_events import stored_events

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode
from kvtier.offload.lazy_walk import lazy_target
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import ScheduledRequest, StepInput, TableUpdate
from kvtier.offload.registration import Registrar
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.stats import StepCounters
from kvtier.offload.store_selection import StoreSelector

FULL = GroupKind.FULL_ATTENTION


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"rules%d" % i).digest(), 0)


def in_tier(engine: SimEngine, request_tokens: range, num_blocks: int) -> list[bool]:
    request = make_request("probe", request_tokens)
    keys = [block_key(engine.layout, request, 0, i) for i in range(num_blocks)]
    return [engine.scheduler.tier_pool.cached_block(k) is not None for k in keys]


def test_a_lazy_walk_counts_the_unhashed_free_blocks_it_visits() -> None:
    """SPEC §6.6/§6.10: the walk selects only hashed blocks; each unhashed block it visits
    (freed before it was ever filled) is counted as dropped_unhashed."""
    gpu = BlockPool(5)
    a, b, c, d = gpu.allocate(4)
    gpu.insert_key(key(0), a, 4)
    gpu.insert_key(key(1), c, 4)
    gpu.free([a, b, c, d])  # b and d were never filled
    scheduler = OffloadScheduler(
        config(store_mode=StoreMode.LAZY, max_batched_tokens=16),  # walks 8 blocks a step
        SchedulerSetup(full_layout(block_size=4), num_tier_blocks=8, gpu_pool=gpu),
    )
    (store,) = scheduler.build_plan(StepInput()).jobs
    assert sorted(store.src_block_ids) == sorted([a, c])
    assert scheduler.take_stats().store_outcomes == {"stored": 2, "dropped_unhashed": 2}


@pytest.mark.parametrize("events", [False, True], ids=["batched", "per-block"])
def test_door_admission_refuses_a_first_sighting_and_stores_the_second(events: bool) -> None:
    """The `door` admission policy (SPEC §6.10 dropped_not_admitted): a block offered for the
    first time is refused and counted; offered again, it is stored. With events on, blocks
    are selected one by one (their payloads are recorded); off, in one batch."""
    engine = SimEngine(full_layout(), config(admission_policy="door", events=events))
    engine.run(make_request("a", range(8)))  # the finish flush offers blocks 0 and 1
    engine.drain()
    assert engine.scheduler.take_stats().store_outcomes == {"dropped_not_admitted": 2}
    assert in_tier(engine, range(8), 2) == [False, False]
    # b hits blocks 0 and 1 on the GPU: confirmed at once, offered again and admitted;
    # its own block 2 is a first sighting at its finish flush.
    engine.run(make_request("b", range(12)))
    engine.drain()
    stats = engine.scheduler.take_stats()
    assert stats.store_outcomes == {"stored": 2, "dropped_not_admitted": 1}
    assert in_tier(engine, range(12), 3) == [True, True, False]
    engine.check()


def test_a_handoff_of_a_scratch_group_block_is_dropped_as_null() -> None:
    """SPEC §6.5 hand-offs: a block of a group that is never cached (scratch) is dropped
    and counted as dropped_null; it is never looked up as a store candidate."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(GroupKind.SCRATCH, 4, 64)))
    engine = SimEngine(layout, num_gpu_blocks=16)
    engine.admit(make_request("a", range(8), outputs=[1]))
    engine.schedule("a")
    engine.step()
    engine.handoff("a", 1, engine.tables["a"][1][0])
    engine.scheduler.take_stats()
    assert engine.step().jobs == ()
    assert engine.scheduler.take_stats().handoff_outcomes == {"dropped_null": 1}


def test_lazy_mode_stores_handoffs_of_running_requests() -> None:
    """SPEC §6.5/§6.6: lazy mode keeps no per-request state, yet a hand-off of a running
    request is stored (only finished or preempted requests' hand-offs are dropped)."""
    layout = KVLayout((KVGroupSpec(FULL, 32, 64), KVGroupSpec(GroupKind.STATE, 16, 64)))
    engine = SimEngine(
        layout, config(store_mode=StoreMode.LAZY), num_gpu_blocks=32, num_tier_blocks=16
    )
    engine.admit(make_request("a", range(32), 16, outputs=[1, 2]))
    engine.schedule("a")
    engine.step()
    state = engine.tables["a"][1][1]  # the state after 32 tokens, keyed on the GPU
    assert engine.gpu.key(state) is not None
    engine.handoff("a", 1, state)
    engine.scheduler.take_stats()
    plan = engine.step()
    assert state in {b for job in plan.jobs if job.is_store for b in job.src_block_ids}
    assert engine.scheduler.take_stats().handoff_outcomes == {"stored": 1}
    engine.drain()
    engine.check()


def test_the_finish_flush_stores_only_confirmed_blocks() -> None:
    """SPEC §6.7 uses §6.5's rule: a finished request's blocks are stored up to its
    confirmed tokens (computed minus output placeholders), not up to its computed ones."""
    engine = SimEngine(full_layout())
    a = make_request("a", range(8), outputs=[8, 9])
    engine.admit(a)
    engine.schedule("a")
    engine.step()  # 8 tokens computed: blocks 0 and 1 are full
    table = list(engine.tables["a"][0])
    a.num_output_placeholders = 1  # ... but one of block 1's tokens is not confirmed
    engine.finish("a")
    (store,) = engine.step().jobs
    assert store.src_block_ids == (table[0],)


@pytest.mark.parametrize("update", list(TableUpdate), ids=lambda update: update.value)
@pytest.mark.parametrize("num_groups", [1, 3])
def test_block_ids_of_another_number_of_groups_are_refused(
    update: TableUpdate, num_groups: int
) -> None:
    """A scheduled request's block ids hold one sequence per KV group. Eager selection
    skips the per-group table update of a request with no new block (most decode steps);
    a step listing another number of groups still raises, new blocks or not."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 6)))
    engine = SimEngine(layout, num_gpu_blocks=16)
    a = make_request("a", range(8), outputs=[1, 2])
    engine.admit(a)
    engine.schedule("a")
    engine.step()  # "a" is tracked, its tables filled
    fine = ScheduledRequest(a, ((), ()), 0, update)
    engine.scheduler.build_plan(StepInput((fine,)))  # two groups, nothing new: no error
    wrong = ScheduledRequest(a, ((),) * num_groups, 0, update)
    message = f"request 'a': block ids for {num_groups} KV groups, the layout has 2"
    with pytest.raises(ValueError, match=message):
        engine.scheduler.build_plan(StepInput((wrong,)))
    if update is TableUpdate.APPEND:  # regression: the zip had extended the first tables
        tables = [list(t) for t in engine.scheduler._selector.tracked["a"].block_ids]
        with_new = ScheduledRequest(a, ((15,),) * num_groups, 0, update)
        with pytest.raises(ValueError, match=message):
            engine.scheduler.build_plan(StepInput((with_new,)))
        assert [list(t) for t in engine.scheduler._selector.tracked["a"].block_ids] == tables


def test_lazy_target_follows_the_group_kinds() -> None:
    """SPEC §6.6: target = 2 x sum over cacheable groups of (state: 2; sliding window:
    ceil(window / block_size) + 1; full: ceil(max_batched_tokens / block_size))."""
    layout = KVLayout(
        (
            KVGroupSpec(FULL, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 6),
            KVGroupSpec(GroupKind.STATE, 4, 64),
            KVGroupSpec(GroupKind.SCRATCH, 4, 64),
        )
    )
    assert lazy_target(layout, 10) == 2 * (3 + (2 + 1) + 2)
    assert lazy_target(full_layout(block_size=4), 16) == 2 * 4


def test_without_fine_grained_hits_a_store_waits_for_the_whole_scheduler_block() -> None:
    """SPEC §6.5: confirmed tokens round down to the scheduler block unless fine-grained.
    Groups of 4 and 8 tokens (scheduler block 8): 12 confirmed tokens store the 4-token
    group's first two blocks and the 8-token group's first, not the 4-token group's
    third, whose scheduler block is not whole yet."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(FULL, 8, 64)))
    engine = SimEngine(layout, num_gpu_blocks=16)
    engine.admit(make_request("a", range(12), outputs=[1]))
    engine.schedule("a")
    engine.step()  # 12 tokens computed
    tables = [list(t) for t in engine.tables["a"]]
    engine.finish("a")
    (store,) = engine.step().jobs
    assert sorted(store.src_block_ids) == sorted([*tables[0][:2], tables[1][0]])


def test_each_stored_block_s_partial_entry_event_carries_its_own_tokens() -> None:
    """Eager, events on, 8-token blocks over 4-token hashes: a block stored under its
    whole key registers the partial entry it also holds (a secondary key), whose event
    carries the payload captured at selection: that block's first 4 tokens, for each
    block of the request (`StoreBatch.secondary_payloads`, by store index)."""
    layout = KVLayout((KVGroupSpec(FULL, 8, 64),), configured_hash_block_size=4)
    request = make_request("r", range(16))
    hashes = request.block_hashes
    gpu = BlockPool(3)
    blocks = gpu.allocate(2)
    for pos, block_id in enumerate(blocks):
        gpu.insert_key(make_key(hashes[2 * pos + 1], 0), block_id, 8)
        gpu.insert_key(make_key(hashes[2 * pos], 0), block_id, 4)  # its partial entry
    tier = BlockPool(4, record_events=True, medium=Tier.CPU.value)
    selector = StoreSelector(
        layout, gpu, tier, StepCounters(), record_payload=True, fine_grained=True
    )
    selector.track("r")
    state = selector.tracked["r"]
    state.block_ids = [list(blocks)]
    request.num_computed_tokens = 16
    selector.select_request(request, state)
    stores = selector.take_queued()
    assert stores.gpu_block_ids == blocks
    Registrar(layout, Tier.CPU, tier, events=True).register_all(stores, gpu)
    tokens = {e.block_hash: tuple(e.token_ids) for e in stored_events(tier.take_events())}
    assert tokens[hashes[0]] == tuple(range(4))
    assert tokens[hashes[2]] == tuple(range(8, 12))
