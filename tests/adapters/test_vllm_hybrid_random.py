"""Random operation sequences on hybrid models through vLLM's real scheduler (SPEC §2).

`test_vllm_random_ops` with several KV cache groups sharing one allocation: full
attention beside sliding windows of different sizes, groups of different block sizes
(a 32-token full-attention group over 16-token hash blocks, and the reverse; hits that
end inside a 32-token block), three groups, two ranks, cascades, vLLM's asynchronous
scheduling. The harness checks every
group of every (re)scheduled request: a full-attention group on every computed
position, a sliding window on the last `window - 1`, and a block a window dropped
(the null block) where one is needed fails too. At the end every tier slot is copied
back and checked against its key's group and positions, and every prompt is replayed
from a zeroed GPU cache. The GPU pools are larger than the one-group test's (24 and 32
blocks): with 16, vLLM 0.33 itself cannot schedule some prompts of two groups.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_harness
from random_ops_driver import KINDS, Engine
from test_vllm_random_ops import explore
from vllm_engine import KVGroupDef, KVMismatchError

FULL = KVGroupDef(16)
ENGINES = [
    Engine("window_eager", kv_groups=(FULL, KVGroupDef(16, 32)), num_gpu_blocks=24),
    Engine("window_lazy", "lazy", kv_groups=(FULL, KVGroupDef(16, 32)), num_gpu_blocks=24),
    Engine(
        "three_groups_two_ranks",
        num_ranks=2,
        kv_groups=(FULL, KVGroupDef(16, 17), KVGroupDef(16, 48)),
        num_gpu_blocks=32,
    ),
    Engine(
        "large_full_blocks_write_back",
        cascade="write_back",
        kv_groups=(KVGroupDef(32), KVGroupDef(16, 40)),
        num_gpu_blocks=24,
    ),
    Engine(
        "large_window_blocks_lazy_write_through",
        "lazy",
        cascade="write_through",
        kv_groups=(FULL, KVGroupDef(32, 50)),
        num_gpu_blocks=24,
    ),
    Engine(
        "large_full_blocks_fine_grained_async",
        async_batches=2,
        kv_groups=(KVGroupDef(32), KVGroupDef(16, 40)),
        num_gpu_blocks=24,
        fine_grained_hits=True,
    ),
    Engine(
        "window_async_pipelined",
        async_batches=2,
        kv_groups=(FULL, KVGroupDef(16, 32)),
        num_gpu_blocks=24,
    ),
]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.name)
def test_random_operations_on_a_hybrid_model_serve_correct_kv(engine: Engine) -> None:
    totals = explore(engine, max_examples=25)
    # Tier hits in the random phase are rare with two groups (a hit needs every group's
    # blocks gone from vLLM's GPU cache and stored); the replay always asks for them.
    assert totals["audited_tier_blocks"] > 0, "no tier block was checked"
    assert totals["preemptions"] > 0
    assert totals["replay_hit_tokens"] > 0, "the replays took nothing from the tier"
    for kind in KINDS if engine.cascade is not None else ("load", "store"):
        assert totals[f"failed_{kind}"] > 0, f"no {kind} failed"
    assert totals["jobs_late"] > 0
    assert totals["aborts"] > 0
    assert totals["reset_both_done"] + totals["reset_connector_done"] > 0
    if engine.cascade is not None:
        assert totals["hit_tokens_DISK"] > 0, "nothing came back from disk"


def test_the_fake_cache_checks_a_sliding_window_on_its_window_only() -> None:
    """The check the random test relies on: a window's group needs its last `window - 1`
    positions, in its own blocks and layers, and nothing before them."""
    harness = kvtier_harness(kv_groups=(FULL, KVGroupDef(16, 32)), num_gpu_blocks=24)
    try:
        cache = harness.caches[0]
        prints = list(range(1, 49))
        tables = ([1, 2, 3], [0, 5, 6])  # the window dropped the group's first block
        cache.write(tables, 0, prints)
        cache.check("r", tables, prints, 48)  # the window's positions 17..47: blocks 5, 6
        with pytest.raises(KVMismatchError, match="group 1 position 17 has no block"):
            cache.check("r", ([1, 2, 3], [0, 0, 6]), prints, 48)
        window_layer = harness.cfg.group_layer_names[1][0]
        cache.tensors[window_layer][6] = 0  # the window's last block, in its layer only
        with pytest.raises(KVMismatchError, match=r"position 32 \(group 1, block 6"):
            cache.check("r", tables, prints, 48)
    finally:
        harness.close()
