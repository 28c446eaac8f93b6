"""Which blocks an unconfirmed finish holds back and whose keys it drops
(`offload/unconfirmed_finish.py`), in layouts the other tests leave out: several groups,
blocks spanning several hash blocks, boundary states other requests hold, and a null
position's key naming blocks of two requests."""

from __future__ import annotations

import pytest
from sim import SimEngine, config, make_request
from test_store_selection_lazy import window_group
from test_unwritten_keys_dropped import stored_blocks

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import make_key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import StoreMode

FULL = GroupKind.FULL_ATTENTION
LAYOUTS = {
    "two-groups": KVLayout((KVGroupSpec(FULL, 4, 64), KVGroupSpec(FULL, 4, 32))),
    "8-over-4": KVLayout((KVGroupSpec(FULL, 8, 64),), configured_hash_block_size=4),
}


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_late_unconfirmed_finish_drops_the_keys_of_every_group_and_whole_block(
    name: str, mode: StoreMode
) -> None:
    """r finished, and s took its blocks as a prefix hit, before the engine learned
    that r's forward failed (`unconfirm_finished`). Every block of r's table, in every
    group and cached under the key of its last hash block, is r's own, whoever holds it
    now: it loses its key and is stored nowhere (a mutant that matched the keys of group
    0 only, or of a block's first hash block only, took s's blocks for another request's
    and kept their keys: a prefix hit on KV never computed)."""
    engine = SimEngine(
        LAYOUTS[name], config(store_mode=mode, max_batched_tokens=16), num_gpu_blocks=12
    )
    r = make_request("r", range(17))
    engine.admit(r)
    engine.schedule("r", 16)
    engine.step()
    table = [list(ids) for ids in engine.tables["r"]]
    engine.finish("r")  # the sim serves no block a failed forward wrote: none failed here
    hit = engine.admit(make_request("s", range(17)))
    assert hit is not None
    assert hit.num_local_tokens == 16  # s holds r's blocks
    engine.scheduler.unconfirm_finished(r, table)
    blocks = [b for ids in table for b in ids if b != NULL_BLOCK_ID]
    assert stored_blocks(engine, 4).isdisjoint(blocks)
    assert [engine.gpu.key(b) for b in blocks] == [None] * len(blocks)
    engine.check()


@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
@pytest.mark.parametrize("index", [0, 1, 3])
def test_every_boundary_state_of_a_failed_forward_loses_its_key(index: int, held: bool) -> None:
    """A state group of 8-token blocks over 4-token hash blocks: vLLM's Mamba "align"
    mode keys a state copied out of the table at a hash-block boundary
    (`boundary_states`). After a failed forward, the state keyed at any of the
    request's hashes loses its key, the first one's too, and whoever holds it (a block
    another request uses is not in r's table: a mutant that dropped only free ones, or
    skipped the first hash, left a hit on a state never computed)."""
    layout = KVLayout(
        (KVGroupSpec(FULL, 8, 64), KVGroupSpec(GroupKind.STATE, 8, 64)),
        configured_hash_block_size=4,
    )
    engine = SimEngine(layout, config(max_batched_tokens=16), num_gpu_blocks=12)
    r = make_request("r", range(17))
    engine.admit(r)
    engine.schedule("r", 16)
    engine.step()
    (copy,) = engine.gpu.allocate(1)  # the state copied out at this boundary, keyed there
    engine.gpu.insert_key(make_key(r.block_hashes[index], 1), copy, 8)
    if not held:
        engine.gpu.free([copy])
    engine.finish("r", computed=False)
    assert engine.gpu.key(copy) is None
    if held:
        engine.gpu.free([copy])
    engine.check()


@pytest.mark.parametrize("first", ["r", "s"])
def test_every_block_under_a_dropped_positions_key_is_held_back(first: str) -> None:
    """r and s compute the same prompt at once, each into its own blocks; r's window
    drops its first two blocks, then r's forward fails. The key of each null position
    names r's freed block and s's block in use, in either order: r's loses its key
    whichever comes first (a mutant holding back the first block of each key only left
    r's cached behind s's: a prefix hit on KV never computed)."""
    layout = KVLayout((KVGroupSpec(FULL, 4, 64), window_group()))
    engine = SimEngine(layout, config(max_batched_tokens=32), num_gpu_blocks=20)
    for request_id in [first, *{"r", "s"} - {first}]:
        engine.admit(make_request(request_id, range(17)))  # the same prompt; neither hits
    for request_id in [first, *{"r", "s"} - {first}]:
        engine.schedule(request_id, 16)
    engine.step()
    dropped, s_window = engine.tables["r"][1][:2], engine.tables["s"][1][:2]
    engine.drop_blocks("r", 1, [0, 1])
    engine.finish("r", computed=False)
    assert [engine.gpu.key(b) for b in dropped] == [None, None]
    assert None not in [engine.gpu.key(b) for b in s_window]
    engine.check()
