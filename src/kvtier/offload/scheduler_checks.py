"""What an `OffloadScheduler` checks in `check_invariants`: every pin is owned by a lookup,
a queued or issued transfer, and the in-flight keys match the stores in flight.

Kept apart from `scheduler` so that module holds the scheduler's operations only; the
checks read its tier state and bookkeeping directly, as its own method would.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvtier.core.keys import Key
from kvtier.offload.cascade import MAX_DEMOTION_ATTEMPTS
from kvtier.offload.plan import Tier

if TYPE_CHECKING:
    from kvtier.offload.scheduler import OffloadScheduler


def check_scheduler_invariants(scheduler: OffloadScheduler) -> None:
    """Raise AssertionError when `scheduler`'s pins, in-flight keys or pools disagree."""
    for pool in scheduler.index.pools.values():
        pool.check_invariants()
    scheduler._eviction.check_invariants()
    scheduler._admission.check_invariants()
    scheduler._book.check_invariants()
    scheduler._reset.check_invariants()
    assert scheduler.loads.recompute_next <= scheduler.loads.allocated, (
        "recompute of a finished request"
    )
    assert scheduler.loads.recompute_unasked <= scheduler.loads.recompute_next
    assert set(scheduler.loads.pins) <= scheduler.loads.looked_up | scheduler.loads.allocated, (
        "a lookup pin of a request neither looked up nor allocated (a reset would miss it)"
    )
    refs = {tier: Counter[int]() for tier in scheduler.index.tiers}
    gpu_refs: Counter[int] = Counter()
    for pin in scheduler.loads.pins.values():
        for tier, ids in scheduler.index.split(pin.pinned):
            refs[tier].update(ids)
    loads = list(scheduler.loads.queued)
    store_batches = [scheduler.selector.queued]
    moves = list(scheduler.cascade.queued) if scheduler.cascade is not None else []
    live_keys: set[Key] = set(scheduler.selector.queued.keys)  # abandoned ones let go
    live_moves = {m.key for m in moves}
    for transfer in scheduler._book:
        loads.extend(transfer.loads)
        store_batches.append(transfer.stores)
        moves.extend(transfer.moves)
        if not transfer.abandoned:
            live_keys.update(transfer.stores.keys)
            live_moves.update(m.key for m in transfer.moves)
    for load in loads:
        refs[load.tier].update(load.tier_block_ids)
        gpu_refs.update(load.gpu_block_ids)
    for stores in store_batches:
        assert len(stores.gpu_block_ids) == len(stores.tier_block_ids) == len(stores)
        indices = [*stores.tails, *stores.payloads, *stores.secondary_payloads, *stores.tags]
        indices += [*stores.loras, *stores.counts, *stores.extra_keys]
        assert all(0 <= i < len(stores) for i in indices)
        refs[scheduler.tier].update(stores.tier_block_ids)
        gpu_refs.update(stores.gpu_block_ids)
    for move in moves:
        refs[Tier.CPU][move.cpu_block_id] += 1
        refs[Tier.DISK][move.disk_block_id] += 1
    set_aside = scheduler.disk_set_aside  # disk slots of failed demotions or stores, held
    if set_aside is not None:
        set_aside.check_invariants()
        refs[Tier.DISK].update(set_aside.held())
    for tier, pool in scheduler.index.pools.items():
        for block_id in range(1, pool.num_blocks):
            assert pool.ref_count(block_id) == refs[tier][block_id], (
                f"{tier.value} block {block_id}: ref {pool.ref_count(block_id)}, "
                f"pins {refs[tier][block_id]}"
            )
    for block_id, count in gpu_refs.items():
        assert scheduler.gpu_pool.block(block_id).ref_count >= count, f"GPU block {block_id}"
    assert scheduler.selector.in_flight_keys == live_keys, "in-flight keys"
    copied = {b for stores in store_batches for b in stores.gpu_block_ids}
    assert scheduler.selector.lazy.copying <= copied, "a lazy copy is tracked but not in flight"
    lazy = scheduler.selector.lazy
    scheduler.selector.loaded.check_invariants()
    assert scheduler.cascade is not None or not scheduler.selector.loaded.by_block, (
        "loaded blocks noted without a cascade (nothing refreshes a disk copy)"
    )
    assert lazy.held.items() <= lazy.stored.items(), "a held-back block the walk may store"
    if scheduler.cascade is not None:
        assert scheduler.cascade.in_flight_keys == live_moves, "in-flight demotions"
        cpu_key = scheduler.cascade.cpu_pool.key
        assert all(cpu_key(b) == k for b, k in scheduler.cascade.dropped), (
            "a dropped demotion outlived its CPU block's key"
        )
        assert all(cpu_key(b) == k for b, k in scheduler.cascade.failed), (
            "a failed demotion outlived its CPU block's key"
        )
        assert all(cpu_key(b) == k for b, k in scheduler.cascade.retry), (
            "a demotion to retry outlived its CPU block's key"
        )
        assert all(0 <= n < MAX_DEMOTION_ATTEMPTS for n in scheduler.cascade.retry.values()), (
            "a demotion to retry has no attempt left"
        )
        retrying = scheduler.cascade.retrying
        assert not retrying.keys() & scheduler.cascade.retry.keys(), "a retry both waits and runs"
        assert all(cpu_key(b) == k and k in live_moves for b, k in retrying), (
            "a retry in flight outlived its CPU block's key or its move"
        )
