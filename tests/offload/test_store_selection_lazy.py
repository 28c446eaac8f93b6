"""Lazy store selection's bookkeeping of copied GPU blocks (SPEC §6.6)."""

from __future__ import annotations

import hashlib

import pytest
from sim import SimEngine, keep_unwritten_keys
from sim_request import config, full_layout, make_request, store_selector

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode
from kvtier.offload.plan import WorkerReport
from kvtier.offload.protocols import ScheduledRequest, StepInput
from kvtier.offload.scheduler import OffloadScheduler, SchedulerSetup
from kvtier.offload.store_selection import StoreSelector


def key(i: int) -> Key:
    return make_key(hashlib.sha256(b"lazy%d" % i).digest(), 0)


def lazy_selector(num_cached: int) -> StoreSelector:
    """Return a selector over a GPU pool of `num_cached` free blocks holding keys 0, 1, ..."""
    gpu = BlockPool(num_cached + 1)
    blocks = gpu.allocate(num_cached)
    for i, block_id in enumerate(blocks):
        gpu.insert_key(key(i), block_id, 4)
    gpu.free(blocks)  # queued in key order
    return store_selector(gpu, BlockPool(8))


def test_completed_lazy_copies_are_remembered_with_their_keys() -> None:
    """A copied block is skipped later (until a request uses it) by its block -> key entry."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    stores = selector.take_queued()
    assert selector.lazy.copying == set(stores.gpu_block_ids)
    selector.lazy.note_stores(stores)
    assert selector.lazy.stored == dict(zip(stores.gpu_block_ids, stores.keys, strict=True))
    assert not selector.lazy.copying


def test_a_block_used_while_its_copy_is_in_flight_is_not_remembered() -> None:
    """A request hitting a block mid-copy makes it a fresh candidate once freed again."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    stores = selector.take_queued()
    (used, other), (_, other_key) = stores.gpu_block_ids, stores.keys
    selector.lazy.note_blocks_in_use([[used]])
    selector.lazy.note_stores(stores)
    assert selector.lazy.stored == {other: other_key}
    assert not selector.lazy.copying


def test_released_lazy_copies_are_forgotten() -> None:
    """A failed or abandoned copy releases its pins and leaves nothing tracked."""
    selector = lazy_selector(2)
    selector.select_lazy(8)
    selector.release(selector.take_queued())
    assert not selector.lazy.copying
    assert not selector.lazy.stored


def test_a_walk_that_selects_every_visited_block_keeps_the_cursor() -> None:
    """The next walk resumes after the last block still free, not from the head.

    Walk 1 visits A and B (already in the tier), walk 2 selects C and D: the cursor stays
    at B, so walk 3 finds nothing new instead of visiting A and B again.
    """
    selector = lazy_selector(4)
    _a, b, c, d = selector.gpu_pool.iter_free_after(None)
    tier = selector.tier_pool
    for i, block_id in enumerate(tier.allocate(2)):
        tier.insert_key(key(i), block_id, 4)  # A's and B's keys
    selector.select_lazy(2)
    assert selector.lazy.cursor == b
    selector.select_lazy(2)
    assert selector.queued.gpu_block_ids == [c, d]
    assert selector.lazy.cursor == b
    selector.select_lazy(2)
    assert selector.counters.store_outcomes == {"stored": 2, "skipped_already_cached": 2}


def test_blocks_a_step_allocates_restart_the_walk_once_freed_again() -> None:
    """The blocks of a step's scheduled requests are noted in use (SPEC §6.6).

    The walk of step 1 leaves its cursor at X; step 2 allocates X to a request and its
    walk selects every block it visits (so it moves no cursor). X is freed at the MRU end
    before step 3: the walk must start from the head, not after X, or it skips E and F.
    """
    gpu = BlockPool(7)
    a, x, c, d, e, f = gpu.allocate(6)
    for i, block_id in enumerate((a, x, c, d, e, f)):
        gpu.insert_key(key(i), block_id, 4)
    gpu.free([a, x])
    layout = full_layout(block_size=4)
    scheduler = OffloadScheduler(
        config(store_mode=StoreMode.LAZY, max_batched_tokens=4),  # walks 2 blocks a step
        SchedulerSetup(layout, num_tier_blocks=16, gpu_pool=gpu),
    )
    tier = scheduler.tier_pool
    for i, block_id in enumerate(tier.allocate(2)):
        tier.insert_key(key(i), block_id, 4)  # A and X are in the tier already
    tier.free(range(1, 3))
    assert scheduler.build_plan(StepInput()).jobs == ()  # step 1 visits A and X
    gpu.touch([a, x])  # step 2 allocates X to a request (and A to another)
    gpu.free([c, d])
    request = make_request("r", range(4))
    step_2 = StepInput(scheduled=(ScheduledRequest(request, ([x],), 4),))
    (store,) = scheduler.build_plan(step_2).jobs
    assert store.src_block_ids == (c, d)
    gpu.free([e, f, x])  # the request finished; X rejoins at the MRU end
    (store,) = scheduler.build_plan(StepInput()).jobs
    assert store.src_block_ids == (e, f)


def test_a_preemption_restarts_the_walk() -> None:
    """SPEC §6.6: a cursor block that left the free queue restarts the walk from the head.

    Step 1 leaves the cursor at X. Before step 2 a running request grows into X and is
    preempted in the same scheduling pass, so X is noted nowhere (the request is not
    scheduled) but rejoins the free queue at the MRU end: a preemption must restart the
    walk, or it would resume after X and skip C and D.
    """
    gpu = BlockPool(5)
    a, x, c, d = gpu.allocate(4)
    for i, block_id in enumerate((a, x, c, d)):
        gpu.insert_key(key(i), block_id, 4)
    gpu.free([a, x])
    scheduler = OffloadScheduler(
        config(store_mode=StoreMode.LAZY, max_batched_tokens=4),  # walks 2 blocks a step
        SchedulerSetup(full_layout(block_size=4), num_tier_blocks=16, gpu_pool=gpu),
    )
    tier = scheduler.tier_pool
    for i, block_id in enumerate(tier.allocate(2)):
        tier.insert_key(key(i), block_id, 4)  # A and X are in the tier already
    tier.free(range(1, 3))
    assert scheduler.build_plan(StepInput()).jobs == ()  # step 1 visits A and X
    gpu.touch([x])  # the running request r grows into X ...
    gpu.free([c, d])  # (another request finished)
    gpu.free([x])  # ... and is preempted: X rejoins at the MRU end
    (store,) = scheduler.build_plan(StepInput(preempted_request_ids=frozenset({"r"}))).jobs
    assert store.src_block_ids == (c,)  # the walk restarted: A (in the tier), then C


def one_block_lazy_scheduler() -> tuple[BlockPool, int, OffloadScheduler]:
    """Return a GPU pool whose one free block Y holds key 0, Y, and a lazy scheduler."""
    gpu = BlockPool(2)
    (y,) = gpu.allocate(1)
    gpu.insert_key(key(0), y, 4)
    gpu.free([y])
    scheduler = OffloadScheduler(
        config(store_mode=StoreMode.LAZY, max_batched_tokens=4),
        SchedulerSetup(full_layout(block_size=4), num_tier_blocks=8, gpu_pool=gpu),
    )
    return gpu, y, scheduler


def evict_tier(scheduler: OffloadScheduler) -> None:
    tier = scheduler.tier_pool
    tier.free(tier.allocate(tier.num_free()))


def test_a_block_a_new_request_takes_mid_copy_is_stored_again_once_its_copy_is_evicted() -> None:
    """SPEC §6.6: `on_allocated` notes an admitted request's blocks in lazy mode too.

    Y's copy is in flight when a request takes Y as a local hit (and, waiting for a load
    or aborted, is not scheduled); freed again, Y is a fresh candidate: once the tier
    evicted its copy, the walk stores it again instead of skipping it as stored before.
    """
    gpu, y, scheduler = one_block_lazy_scheduler()
    (store,) = scheduler.build_plan(StepInput()).jobs
    gpu.touch([y])  # a new request's local hit
    assert scheduler.on_allocated(make_request("r", range(4)), [[y]], 0) == {}
    scheduler.apply_report(WorkerReport(done={store.event_id: 1}))
    gpu.free([y])  # the request is aborted
    evict_tier(scheduler)
    (again,) = scheduler.build_plan(StepInput()).jobs
    assert again.src_block_ids == (y,)


def test_after_a_reset_the_walk_stores_blocks_it_copied_before() -> None:
    """SPEC §6.9: a reset empties the tier and clears lazy mode's memory of what it copied:
    a block copied before the reset is stored again."""
    _, y, scheduler = one_block_lazy_scheduler()
    (store,) = scheduler.build_plan(StepInput()).jobs
    scheduler.apply_report(WorkerReport(done={store.event_id: 1}))
    assert scheduler.build_plan(StepInput()).jobs == ()  # in the tier
    assert scheduler.reset() is True
    (again,) = scheduler.build_plan(StepInput()).jobs
    assert again.src_block_ids == (y,)
    scheduler.check_invariants()


def test_lazy_mode_does_not_flush_a_finished_request() -> None:
    """SPEC §6.6/§6.7: lazy mode keeps no per-request state and has no finish flush; a
    finished request's blocks wait in the GPU free queue until the walk reaches them."""
    engine = SimEngine(
        full_layout(), config(store_mode=StoreMode.LAZY, max_batched_tokens=4), num_gpu_blocks=32
    )
    engine.run(make_request("a", range(8)))  # the walk visits 2 never-used blocks a step
    assert not engine.scheduler.has_pending_stores()
    assert engine.step().jobs == ()


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY])
def test_blocks_of_an_unconfirmed_finish_are_not_stored_until_used_again(
    mode: StoreMode, reset: bool
) -> None:
    """Regression (lazy): a request finished with `computed=False` (its forward failed)
    whose blocks the engine frees with their keys, as vLLM does, had them stored by the
    next walk: a later hit would have loaded KV that was never computed. A tier reset
    in between used to forget that they were held back. A hit on them released them
    (tests/offload/test_same_step_victim_hits.py). The engine here keeps the blocks'
    keys (`keep_unwritten_keys`; kvtier asks it to drop them)."""
    engine = SimEngine(
        full_layout(), config(store_mode=mode, max_batched_tokens=8), num_gpu_blocks=8
    )
    keep_unwritten_keys(engine)
    engine.admit(make_request("r", range(12)))
    engine.schedule("r")
    engine.step()  # its 2 whole blocks are cached in the GPU pool
    (held,) = engine.tables["r"]
    engine.finish("r", computed=False)
    if reset:
        assert engine.scheduler.reset()
    for _ in range(3):
        assert [job for job in engine.step().jobs if job.is_store] == []
        engine.scheduler.check_invariants()
    if mode is StoreMode.LAZY:
        # A GPU hit reads them and writes nothing: still held once freed again (the sim
        # wrote them, but the engine's failed forward may not have).
        assert engine.admit(make_request("s", range(12))).num_local_tokens == 8
        engine.schedule("s")
        engine.step()
        engine.finish("s")
        stored = {b for _ in range(3) for job in engine.step().jobs for b in job.src_block_ids}
        assert stored.isdisjoint(held[:2])
        # Taken afresh and computed again, a request's blocks are stored as any others.
        engine.evict_gpu()
        engine.admit(make_request("t", range(12)))
        computed = engine.tables["t"][0][:2]
        engine.schedule("t")
        engine.step()
        engine.finish("t")
        stored = {b for _ in range(3) for job in engine.step().jobs for b in job.src_block_ids}
        assert set(computed) <= stored
        engine.scheduler.check_invariants()


def test_blocks_a_window_dropped_before_an_unconfirmed_finish_are_not_stored() -> None:
    """Regression (lazy, sliding window): a forward that failed wrote blocks the window
    then dropped (freed with their keys; vLLM drops at schedule time, before an
    overlapped forward's failure is known). `on_finished(computed=False)` held back
    only the table's blocks, so the next walks stored the dropped ones: KV never
    computed, under its valid key, in the tier."""
    layout = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64), window_group()))
    engine = SimEngine(
        layout, config(store_mode=StoreMode.LAZY, max_batched_tokens=16), num_gpu_blocks=12
    )
    engine.admit(make_request("r", range(17)))
    engine.schedule("r")
    engine.step()  # one chunk of 16 tokens: 4 whole blocks per group, hashed
    dropped = engine.tables["r"][1][:2]
    engine.drop_blocks("r", 1, [0, 1])  # out of the 8-token window
    engine.finish("r", computed=False)
    stored = {b for _ in range(4) for job in engine.step().jobs for b in job.src_block_ids}
    assert stored.isdisjoint(dropped)
    engine.scheduler.check_invariants()


def window_group() -> KVGroupSpec:
    return KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 8)


def test_a_block_keyed_afresh_since_its_copy_is_stored_under_its_new_key() -> None:
    """SPEC §6.6: the walk skips a block it copied before only while it holds the key
    copied. One that took another key unnoticed (a request that grew into it was
    preempted in the same scheduling pass, so no plan named it) holds other KV: the
    walk stores it under its new key."""
    selector = lazy_selector(1)
    selector.select_lazy(8)
    stores = selector.take_queued()
    selector.lazy.note_stores(stores)
    (block,) = stores.gpu_block_ids
    gpu = selector.gpu_pool
    gpu.free([block])  # the copy completed (its pin and in-flight key go) ...
    selector.in_flight_keys.difference_update(stores.keys)  # ... and the tier evicted it
    selector.select_lazy(8)
    assert not selector.queued
    assert selector.counters.store_outcomes == {"stored": 1, "skipped_stored_before": 1}
    assert gpu.allocate(1) == [block]  # its key goes
    gpu.insert_key(key(5), block, 4)
    gpu.free([block])
    selector.lazy.cursor = None  # the preemption restarts the walk
    selector.select_lazy(8)
    assert selector.queued.keys == [key(5)]
