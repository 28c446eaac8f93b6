"""A null block inside a run of the batched store path (`store_runs.select_run`)."""

from __future__ import annotations

import pytest
from sim import SimEngine, block_key, config, make_request

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout


@pytest.mark.parametrize("events", [False, True], ids=["batched", "per-block"])
def test_a_null_block_after_a_stored_one_is_recovered_from_the_gpu_cache(events: bool) -> None:
    """SPEC §6.5: a null table entry is looked up in the GPU cache wherever it sits, so a
    run of plain blocks ends at a null one and the null one is recovered: the batched path
    stores what the per-block path stores."""
    layout = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, 4),
        )
    )
    engine = SimEngine(layout, config(events=events), num_gpu_blocks=24, num_tier_blocks=16)
    a = make_request("a", range(12))
    assert engine.admit(a) is not None
    engine.schedule("a")
    engine.step()
    sliding = list(engine.tables["a"][1])
    engine.drop_blocks("a", 1, [1])  # a null between two plain blocks
    assert engine.gpu.cached_block(block_key(layout, a, 1, 1)) == sliding[1]
    engine.scheduler.take_stats()
    engine.finish("a")
    (store,) = engine.step().jobs
    assert set(sliding) <= set(store.src_block_ids)
    assert NULL_BLOCK_ID not in store.src_block_ids
    assert engine.scheduler.take_stats().store_outcomes == {"stored": 6}
    engine.drain()
    engine.check()
