"""Blocks the offload scheduler knows no forward wrote lose their keys in the engine's pool.

vLLM 0.33 hashes blocks as it schedules them and keeps those hashes when a failed
forward's requests are aborted, or when the priority policy preempts a request in the
step that scheduled it; its prefix cache then serves KV never written. The offload
scheduler holds such blocks back from its tiers and asks the engine's pool to drop their
keys (`GpuPoolView.discard_keys_of`), so a later request with that prompt recomputes.
"""

from __future__ import annotations

import pytest
from sim import Admission, SimEngine, config, full_layout, keep_unwritten_keys, make_request
from test_same_step_preemption import schedule_then_preempt, victim_engine
from test_store_selection_lazy import window_group

from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode


def stored_blocks(engine: SimEngine, steps: int) -> set[int]:
    """Return the GPU blocks the store jobs of the next `steps` steps copy."""
    return {b for _ in range(steps) for job in engine.step().jobs for b in job.src_block_ids}


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_same_step_victims_unwritten_blocks_lose_their_keys(mode: StoreMode) -> None:
    engine = victim_engine(mode)
    engine.admit(make_request("r", range(33)))
    engine.schedule("r", 8)
    engine.step()  # blocks 0 and 1 written
    written = engine.tables["r"][0][:2]
    unwritten = schedule_then_preempt(engine, "r", 8)
    assert len(unwritten) == 2
    engine.step()  # the plan that learns of the preemption
    assert [engine.gpu.key(b) for b in unwritten] == [None, None]
    assert all(engine.gpu.key(b) is not None for b in written)  # only those
    hit = engine.admit(make_request("s", range(33)))  # the same prompt
    assert hit is not None
    assert hit.num_local_tokens == 8  # the written blocks only (the sim checks its reads)
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_an_unconfirmed_finishs_blocks_lose_their_keys_and_are_computed_again(
    mode: StoreMode,
) -> None:
    engine = SimEngine(
        full_layout(), config(store_mode=mode, max_batched_tokens=8), num_gpu_blocks=8
    )
    engine.admit(make_request("r", range(12)))
    engine.schedule("r")
    engine.step()  # its 2 whole blocks are cached in the GPU pool
    held = engine.tables["r"][0][:2]
    engine.finish("r", computed=False)
    assert [engine.gpu.key(b) for b in held] == [None, None]
    assert stored_blocks(engine, 3).isdisjoint(held)
    admission = engine.run(make_request("s", range(12)))
    assert admission.num_local_tokens == 0  # recomputed
    stored_blocks(engine, 4)  # lazy: the walks after its finish store its blocks
    engine.drain()
    engine.evict_gpu()
    again = engine.admit(make_request("t", range(12)))
    assert again is not None
    assert (again.num_local_tokens, again.num_offered_tokens) == (0, 8)  # s's, stored
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_late_unconfirmed_finish_leaves_blocks_another_request_took_since(
    mode: StoreMode,
) -> None:
    """A finish learned unconfirmed only later (`unconfirm_finished`: vLLM's user abort
    while the failed step was in flight): the engine may have given its blocks to another
    request since, which keys them as its own; those keep their keys and are stored.
    Written by a mutation check: holding back the finished request's whole table dropped
    the other request's keys (a lost hit, and a lost store) unnoticed."""
    engine = SimEngine(
        full_layout(), config(store_mode=mode, max_batched_tokens=12), num_gpu_blocks=4
    )
    r = make_request("r", range(12))
    engine.admit(r)
    engine.schedule("r")
    engine.step()
    table = [list(ids) for ids in engine.tables["r"]]
    engine.finish("r")
    engine.drain()  # r's stores release its blocks
    engine.admit(make_request("y", range(100, 112)))
    engine.schedule("y")
    engine.step()
    assert sorted(engine.tables["y"][0]) == sorted(table[0])  # every block of r, taken
    engine.scheduler.unconfirm_finished(r, table)
    assert None not in [engine.gpu.key(b) for b in table[0][:2]]  # y's keys
    engine.finish("y")
    stored_blocks(engine, 4)
    engine.drain()
    engine.evict_gpu()
    again = engine.admit(make_request("t", range(100, 112)))
    assert again is not None
    assert again.num_offered_tokens == 8  # y's 2 whole blocks, stored
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_blocks_a_window_dropped_before_an_unconfirmed_finish_lose_their_keys(
    mode: StoreMode,
) -> None:
    """The blocks a sliding window dropped (freed with the request's keys) before a
    failed forward's finish are held back and lose their keys too: with another
    request's valid full-attention blocks at those positions still cached, the engine
    could otherwise serve them in a prefix hit. Written by a mutation check: dropping
    the keys of the table's blocks only (`keys_to_drop`) went unnoticed."""
    layout = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64), window_group()))
    engine = SimEngine(layout, config(store_mode=mode, max_batched_tokens=16), num_gpu_blocks=12)
    engine.admit(make_request("r", range(17)))
    engine.schedule("r")
    engine.step()  # one chunk of 16 tokens: 4 whole blocks per group, hashed
    dropped = engine.tables["r"][1][:2]
    engine.drop_blocks("r", 1, [0, 1])  # out of the 8-token window
    assert None not in [engine.gpu.key(b) for b in dropped]
    engine.finish("r", computed=False)
    assert [engine.gpu.key(b) for b in dropped] == [None, None]
    engine.check()


def test_a_window_block_recovered_by_key_is_never_a_failed_forwards_copy() -> None:
    """A null window position is recovered from the GPU cache by its key (SPEC §6.5),
    but not from a block of unconfirmed compute: x's forward failed and its blocks keep
    their keys (an engine that ignores `discard_keys_of`); y computes the same prompt
    into its own blocks, drops its window's first two and finishes. Their recovery
    stores y's copies of those keys, never x's unwritten blocks."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, config(store_mode=StoreMode.EAGER), num_gpu_blocks=24)
    keep_unwritten_keys(engine)
    engine.admit(make_request("x", range(13)))
    engine.schedule("x")
    engine.step()
    x_first = engine.tables["x"][0][0]
    engine.fail_forward("x")
    engine.finish("x", computed=False)
    engine.gpu.discard_keys(x_first)  # y misses its first block: it computes all
    assert engine.admit(make_request("y", range(13))) == Admission(0, 0, 0)
    engine.schedule("y")
    engine.step()
    y_blocks = {b for table in engine.tables["y"] for b in table}  # x's reused too
    window = list(engine.tables["y"][1])
    engine.drop_blocks("y", 1, [0, 1])
    engine.finish("y")
    (store,) = engine.step().jobs
    assert set(window[:2]) <= set(store.src_block_ids)
    assert set(store.src_block_ids) <= y_blocks  # none of x's left unwritten
    engine.drain()
    engine.check()


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_a_finish_learned_unconfirmed_before_the_next_plan_stores_none_of_its_blocks(
    mode: StoreMode,
) -> None:
    """r's finish queues its final stores (eager: its 4 whole blocks); before the next
    plan the engine learns that the forward counted in them failed (`unconfirm_finished`:
    vLLM's user abort while that step was in flight). The queued stores are dropped:
    issued, they copied KV never computed into the tier under r's keys (a mutant that
    kept them stored all 4 blocks, wrong KV for any later hit)."""
    engine = SimEngine(
        full_layout(), config(store_mode=mode, max_batched_tokens=16), num_gpu_blocks=8
    )
    r = make_request("r", range(17))
    engine.admit(r)
    engine.schedule("r", 16)
    engine.step()  # computes 0-16: nothing confirmed at this plan
    table = [list(ids) for ids in engine.tables["r"]]
    engine.fail_forward("r")
    engine.finish("r")
    engine.scheduler.unconfirm_finished(r, table)
    assert stored_blocks(engine, 4).isdisjoint(table[0])
    assert [engine.gpu.key(b) for b in table[0]] == [None] * 4
    engine.check()


def test_an_unconfirmed_finish_leaves_the_keys_of_blocks_another_request_runs_on() -> None:
    """r and s compute the same prompt at once, each into its own blocks. r's window
    drops its first two blocks, then r's forward fails: the keys of those null
    positions name r's freed blocks and s's blocks in use. Only r's lose them: s wrote
    its own and runs on them (a mutant dropping every held block's keys took s's too:
    a lost prefix hit on valid KV)."""
    layout = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64), window_group()))
    engine = SimEngine(layout, config(max_batched_tokens=32), num_gpu_blocks=20)
    engine.admit(make_request("r", range(17)))
    engine.admit(make_request("s", range(17)))  # the same prompt; neither hits
    engine.schedule("r", 16)
    engine.schedule("s", 16)
    engine.step()
    dropped, s_window = engine.tables["r"][1][:2], engine.tables["s"][1][:2]
    engine.drop_blocks("r", 1, [0, 1])
    engine.finish("r", computed=False)
    assert [engine.gpu.key(b) for b in dropped] == [None, None]
    assert None not in [engine.gpu.key(b) for b in s_window]
    engine.check()


def test_a_boundary_state_keyed_past_the_state_tables_length_loses_its_key() -> None:
    """A state group of 8-token blocks over 4-token hash blocks: a request's table of 2
    positions spans 4 hashes, and vLLM's Mamba "align" mode may key a copied-out state
    at any of them (`boundary_states`). After a failed forward each loses its key,
    the one at the third hash too (a mutant looking at one hash per table position
    left it cached, a hit on a state never computed)."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 64),
            KVGroupSpec(GroupKind.STATE, 8, 64),
        ),
        configured_hash_block_size=4,
    )
    engine = SimEngine(layout, config(max_batched_tokens=16), num_gpu_blocks=12)
    r = make_request("r", range(17))
    engine.admit(r)
    engine.schedule("r", 16)
    engine.step()
    (copy,) = engine.gpu.allocate(1)  # the state copied out at token 12, keyed there
    engine.gpu.insert_key(make_key(r.block_hashes[2], 1), copy, 8)
    engine.gpu.free([copy])
    engine.finish("r", computed=False)
    assert engine.gpu.key(copy) is None
    engine.check()
