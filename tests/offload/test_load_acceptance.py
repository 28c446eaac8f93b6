"""Regressions of `on_allocated` (SPEC §6.3): what a load pairs when the engine accepts less.

A hit's first blocks serve a shorter prefix only in full-attention groups; a sliding
window or a state needs the blocks just before the accepted end.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key, config, make_request
from test_cascade_promotion_uses import A_KEYS, _evict_from_cpu
from test_scenarios_cascade import cascade_engine, holds

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier
from kvtier.offload.transfers import FailedLoad

FULL = GroupKind.FULL_ATTENTION


def stored_engine(second: KVGroupSpec, tokens: range) -> SimEngine:
    """Return an engine whose tier holds every block of a request of `tokens`."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), second))
    engine = SimEngine(layout, config(), num_gpu_blocks=32, num_tier_blocks=16)
    engine.run(make_request("a", tokens))
    engine.drain()
    engine.evict_gpu()
    return engine


def loaded_pairs(engine: SimEngine, request_id: str) -> tuple[dict[int, int], list[list[int]]]:
    """Step once, which issues the request's one load (poll() checks the loaded
    content); return the load's GPU block -> tier slot pairs and the request's tables."""
    (load,) = engine.step().jobs
    pairs = dict(zip(load.dst_block_ids, load.src_block_ids, strict=True))
    return pairs, engine.tables[request_id]


def test_a_shorter_acceptance_loads_the_sliding_window_before_its_end() -> None:
    """Scenario 6, hybrid: accepting 8 of 20 offered tokens loads sliding-window block 1."""
    engine = stored_engine(KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4), range(20))
    b = make_request("b", [*range(20), 7])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 20
    engine.allocate(b, found, 8)
    pairs, (full, sliding) = loaded_pairs(engine, "b")
    tier = engine.scheduler.tier_pool
    assert pairs == {
        full[0]: tier.cached_block(block_key(engine.layout, b, 0, 0)),
        full[1]: tier.cached_block(block_key(engine.layout, b, 0, 1)),
        sliding[1]: tier.cached_block(block_key(engine.layout, b, 1, 1)),
    }
    engine.schedule("b")
    engine.step()  # check_kv before the forward pass: every block b reads is right
    engine.check()


def test_a_shorter_acceptance_without_a_state_at_its_end_is_recomputed() -> None:
    """Scenario 6, hybrid: a state group needs the state at the accepted end; absent, the
    load fails and the engine recomputes."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(GroupKind.STATE, 4, 64)))
    engine = SimEngine(layout, config(), num_gpu_blocks=32, num_tier_blocks=16)
    a = make_request("a", range(16), outputs=[1])
    engine.admit(a)
    engine.schedule("a")
    engine.step()
    engine.handoff("a", 1, engine.tables["a"][1][3])  # only the state after 16 tokens
    engine.schedule("a")
    engine.step()
    engine.finish("a")
    engine.drain()
    engine.evict_gpu()
    b = make_request("b", [*range(16), 7])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 16
    engine.allocate(b, found, 8)  # the state after 8 tokens was never stored
    plan = engine.step()
    assert not [job for job in plan.jobs if job.is_load]
    assert engine.outcomes[-1].failed_loads == (FailedLoad("b", 0, 8),)
    assert "b" not in engine.loading
    engine.schedule("b")
    engine.step()
    engine.check()


@pytest.mark.parametrize("table_end", [0, 1])
def test_a_bad_block_table_raises_and_leaves_no_pin(table_end: int) -> None:
    """A table too short (or with a null destination) raises; the lookup pin is released."""
    engine = stored_engine(KVGroupSpec(FULL, 4, 64), range(12))
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    tables = [engine.gpu.allocate(3), engine.gpu.allocate(3)]
    tables[1] = tables[1][:table_end] + [0] * (3 - table_end) if table_end else []
    with pytest.raises(ValueError, match="group 1"):
        engine.scheduler.on_allocated(b, tables, 12)
    pool = engine.scheduler.tier_pool
    assert all(pool.ref_count(block) == 0 for block in range(1, pool.num_blocks))
    engine.gpu.free([block for table in tables for block in table])
    engine.check()


def test_a_declined_hit_releases_its_pin_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """An engine may accept none of an offered hit (vLLM does on some hybrid paths): the
    lookup pin goes, nothing loads, and no warning is logged for a normal outcome."""
    engine = stored_engine(KVGroupSpec(FULL, 4, 64), range(16))
    b = make_request("b", [*range(16), 7])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 16
    with caplog.at_level("WARNING", logger="kvtier"):
        engine.allocate(b, found, 0)
    assert not caplog.records
    assert "b" not in engine.scheduler.loads.pins
    assert engine.step().jobs == ()
    engine.check()


def test_a_shorter_acceptance_after_a_local_prefix_loads_the_blocks_after_it() -> None:
    """As above, after a local prefix of 4 tokens (block 0 of both groups cached on the
    GPU): the hit of the 8 accepted tokens is looked up again from the prefix's end, so
    block 2 of each group's load is the request's block 2, not its block 1."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4)))
    engine = SimEngine(layout, config(), num_gpu_blocks=32, num_tier_blocks=16)
    a = make_request("a", range(20))
    engine.run(a)
    engine.drain()
    firsts = {block_key(layout, a, group_id, 0) for group_id in (0, 1)}
    for block_id in range(1, engine.gpu.num_blocks):  # only block 0 stays on the GPU
        if engine.gpu.key(block_id) not in (None, *firsts):
            engine.gpu.discard_keys(block_id)
    b = make_request("b", [*range(20), 7])
    found = engine.lookup(b)
    assert (found.num_local_tokens, found.num_offered_tokens) == (4, 16)
    engine.allocate(b, found, 8)
    pairs, (full, sliding) = loaded_pairs(engine, "b")
    tier = engine.scheduler.tier_pool
    assert pairs == {
        full[1]: tier.cached_block(block_key(layout, b, 0, 1)),
        full[2]: tier.cached_block(block_key(layout, b, 0, 2)),
        sliding[2]: tier.cached_block(block_key(layout, b, 1, 2)),
    }
    engine.schedule("b")
    engine.step()  # check_kv before the forward pass: every block b reads is right
    engine.check()


def test_a_shorter_acceptance_loads_the_pinned_copies_not_newer_ones() -> None:
    """SPEC §6.3: the load takes the first pinned blocks of the hit. b's lookup pins a's
    blocks on disk; c then promotes them into the CPU tier before b is allocated. b,
    accepting 8 of its 12 tokens, loads its two pinned disk copies, as it would have
    loaded all 12: the lookup's hit is not looked up again (a full-attention layout)."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, 4, 12)
    engine.run(make_request("a", range(12)))
    engine.drain()
    _evict_from_cpu(engine, 100)
    b = make_request("b", [*range(12), 7])
    found = engine.lookup(b)
    assert found.num_offered_tokens == 12
    engine.run(make_request("c", [*range(12), 8]))  # loads from disk, promotes to CPU
    engine.drain()
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS)
    engine.allocate(b, found, 8)
    (load,) = [job for job in engine.step().jobs if job.is_load]
    assert (load.src_tier, load.num_blocks) == (Tier.DISK, 2)
    engine.check()
