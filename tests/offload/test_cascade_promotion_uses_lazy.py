"""Write-through: one use of a promoted block is one disk touch for lazy and hand-off stores too.

Lazy stores (the walk over freed GPU blocks) and hand-offs are tied to no request's
table, so the rule of `test_cascade_promotion_uses` is kept per GPU block
(`loaded_blocks`): a store of a block a load filled, with no other request using it
since, is the loading request's use, which its load counted (regression: the demotion
refreshed the disk copy again, LFU-DA counted 2 for one use). A block another request
used, or handed off, counts that request's use.
"""

from __future__ import annotations

from sim import SimEngine, make_request
from test_cascade_promotion_uses import A_KEYS, _disk_uses
from test_scenarios_cascade import cascade_engine, holds

from kvtier.offload.config import CascadeMode, StoreMode
from kvtier.offload.plan import Tier


def _settle(engine: SimEngine) -> None:
    """Step once (a lazy walk stores freed blocks), then until no store is pending."""
    engine.step()
    engine.drain()


def _engine(store_mode: StoreMode) -> SimEngine:
    """Store "a" (3 blocks, CPU + disk, counted once in LFU-DA), then evict it from the
    CPU tier (by "other") and from the GPU: its blocks are on disk only."""
    engine = cascade_engine(
        CascadeMode.WRITE_THROUGH, 4, 12, eviction_policy="lfuda", store_mode=store_mode
    )
    engine.run(make_request("a", range(12)))
    _settle(engine)
    engine.run(make_request("other", range(100, 112)))
    _settle(engine)
    assert not any(holds(engine, Tier.CPU, key) for key in A_KEYS)
    engine.evict_gpu()
    assert [_disk_uses(engine, key) for key in A_KEYS] == [1, 1, 1]
    return engine


def _load(engine: SimEngine, request_id: str, last: int) -> list[int]:
    """Admit a request for a's prompt, wait for its disk load; return its loaded blocks."""
    admission = engine.admit(make_request(request_id, [*range(12), last]))
    assert admission is not None
    assert admission.num_accepted_tokens == 12
    while request_id in engine.loading:
        engine.step()
    return engine.tables[request_id][0][:3]


def test_a_lazy_promotion_counts_one_use() -> None:
    engine = _engine(StoreMode.LAZY)
    engine.run(make_request("b", [*range(12), 7]))
    _settle(engine)
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS), "not promoted"
    assert [_disk_uses(engine, key) for key in A_KEYS] == [2, 2, 2]  # stored, then b
    engine.check()


def test_a_lazy_store_of_a_block_another_request_used_counts_its_use() -> None:
    """c hits b's loaded blocks on the GPU while b runs: the walk's store, once both
    finished, is c's use too."""
    engine = _engine(StoreMode.LAZY)
    _load(engine, "b", 7)
    admission = engine.run(make_request("c", [*range(12), 9]))
    assert admission.num_local_tokens == 12
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    _settle(engine)
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS), "not promoted"
    assert [_disk_uses(engine, key) for key in A_KEYS] == [3, 3, 3]
    engine.check()


def _handed_off(store_mode: StoreMode, offerer: str) -> list[int]:
    """b loads a's blocks from disk; `offerer` (b, or c hitting them on the GPU) hands
    them off; return their LFU-DA counts once stored."""
    engine = _engine(store_mode)
    blocks = _load(engine, "b", 7)
    if offerer != "b":
        admission = engine.admit(make_request(offerer, [*range(12), 9]))
        assert admission is not None
        assert admission.num_local_tokens == 12
    for block_id in blocks:
        engine.handoff(offerer, 0, block_id)
    engine.step()  # nothing scheduled: only the hand-offs are stored
    engine.drain()
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS), "not promoted"
    uses = [_disk_uses(engine, key) for key in A_KEYS]
    engine.check()
    return uses


def test_a_handed_off_promotion_counts_one_use_eager() -> None:
    assert _handed_off(StoreMode.EAGER, "b") == [2, 2, 2]


def test_a_handed_off_promotion_counts_one_use_lazy() -> None:
    assert _handed_off(StoreMode.LAZY, "b") == [2, 2, 2]


def test_a_block_another_request_hands_off_counts_its_use() -> None:
    assert _handed_off(StoreMode.EAGER, "c") == [3, 3, 3]
    assert _handed_off(StoreMode.LAZY, "c") == [3, 3, 3]


def test_a_reset_forgets_which_blocks_loads_filled() -> None:
    """b loads a's blocks from disk, then the tiers are reset (SPEC §6.9): what b loaded
    is no tier's copy any more. c computes the same prompt afresh (skipping the GPU
    cache), its copies reach disk, and leave the CPU tier. b's blocks, stored by the
    walk once b finishes, are then a use of c's disk copies like any other: counted
    (LFU-DA's counts outlive the reset: 3, then 4). A mutant kept the load's record
    across the reset: the store counted as b's load's use, the disk copies untouched."""
    engine = _engine(StoreMode.LAZY)
    _load(engine, "b", 7)
    assert engine.scheduler.reset()
    engine.run(make_request("c", [*range(12), 9], skip_prefix_cache=True))
    _settle(engine)
    engine.run(make_request("other", range(200, 212)))  # evicts c's copies from the CPU
    _settle(engine)
    assert not any(holds(engine, Tier.CPU, key) for key in A_KEYS)
    assert [_disk_uses(engine, key) for key in A_KEYS] == [3, 3, 3]
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    _settle(engine)
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS), "not promoted"
    assert [_disk_uses(engine, key) for key in A_KEYS] == [4, 4, 4]
    engine.check()
