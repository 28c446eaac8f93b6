"""The bytes of a tier slot: the same in the scheduler role's sizing and the worker's regions.

Regressions: a `UniformTypeKVCacheSpecs` group (layers of one kind, different page
sizes) reaches vLLM's scheduler as one of its layers' specs, so the scheduler role sized
the tiers for 256 slots while the worker held 170 (slots past the worker's tier); such
groups were then refused, and are now sized from their placements in the scheduler
role (refused only where a padded layer-outermost page hides its size); and nothing
checked that the worker's registered regions hold the bytes its tiers were sized for.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.adapters.vllm import layout
from kvtier.adapters.vllm.layout import (
    UnsupportedLayoutError,
    bytes_per_slot,
    kv_layout,
    tier_sizes,
)
from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier

LAYOUT = "LBNHC"
NUM_BLOCKS = 16
BUDGET = OffloadConfig(cpu_bytes=1 << 20)


def spec(num_kv_heads: int, head_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16
    )


def one_layer_config() -> KVCacheConfig:
    """One full-attention layer of 2048-byte pages, as vLLM's planner places it."""
    page = spec(2).page_size_bytes
    tensor = KVCacheTensor(NUM_BLOCKS * page, ["a"], NUM_BLOCKS * page, page, 0)
    return KVCacheConfig(NUM_BLOCKS, [tensor], [KVCacheGroupSpec(["a"], spec(2))])


def uniform_config() -> KVCacheConfig:
    """Layers "a" (2048-byte pages) and "b" (4096) in one group, placed as vLLM's planner
    places them with a layer-outermost layout (`get_kv_cache_config_from_groups`)."""
    specs = {"a": spec(2), "b": spec(4)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    size = NUM_BLOCKS * (2048 + 4096)
    tensors = [
        KVCacheTensor(size, ["a"], NUM_BLOCKS * 2048, 2048, 0),
        KVCacheTensor(size, ["b"], NUM_BLOCKS * 4096, 4096, NUM_BLOCKS * 2048),
    ]
    return KVCacheConfig(NUM_BLOCKS, tensors, [KVCacheGroupSpec(["a", "b"], uniform)])


def registered_side(config: KVCacheConfig, layout_name: str = LAYOUT) -> WorkerSide:
    side = WorkerSide(config, BUDGET, layout_name, ())
    buffer = torch.zeros(max(int(t.size) for t in config.kv_cache_tensors), dtype=torch.uint8)
    side.register_kv_caches({name: buffer for t in config.kv_cache_tensors for name in t.layers})
    return side


def test_the_worker_registers_the_slot_bytes_its_tiers_were_sized_for() -> None:
    side = registered_side(one_layer_config())
    try:
        assert side.worker.bytes_per_slot == bytes_per_slot(one_layer_config()) == 2048
    finally:
        side.worker.shutdown()


def test_register_refuses_regions_of_other_slot_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizing and regions are two computations of one number; were they ever to drift,
    the worker must refuse rather than hold tiers of another size than planned."""
    real = layout.placement_slot_bytes
    monkeypatch.setattr(layout, "placement_slot_bytes", lambda config: real(config) + 4096)
    with pytest.raises(RuntimeError, match=r"hold 2048 B per KV block id.*sized for 6144 B"):
        registered_side(one_layer_config())


def test_a_group_of_different_page_sizes_is_sized_alike_in_both_roles() -> None:
    """The scheduler's copy holds one layer's spec; its tiers still hold the worker's
    170 slots of 2048 + 4096 B (pages read from the placement), not 256 of 2048 B."""
    worker_config = uniform_config()
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])  # vLLM's own
    assert tier_sizes(BUDGET, scheduler_config) == tier_sizes(BUDGET, worker_config)
    assert tier_sizes(BUDGET, worker_config) == {Tier.CPU: (1 << 20) // (2048 + 4096)}
    side = registered_side(worker_config)
    try:
        assert side.worker.bytes_per_slot == bytes_per_slot(scheduler_config) == 2048 + 4096
    finally:
        side.worker.shutdown()


def planned(layout_name: str, *group_specs: dict[str, AttentionSpec]) -> KVCacheConfig:
    """A group of each of `group_specs` placed by vLLM's own planner in `layout_name`."""
    groups = []
    for specs in group_specs:
        uniform = UniformTypeKVCacheSpecs.from_specs(specs)
        assert uniform is not None
        groups.append(KVCacheGroupSpec(list(specs), uniform))
    layout_of = SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout_name])
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=layout_of.get_resolved_kv_cache_layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
    )
    return get_kv_cache_config_from_groups(vllm_config, groups, 1 << 20)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize("alignment", [None, 1000])
def test_vllm_s_placements_of_mixed_pages_are_sized_alike_in_both_roles(
    layout_name: str, alignment: int | None
) -> None:
    """Layer- and block-outermost placements, blocks padded to 1000-byte multiples or not
    (block-outermost: the padding follows the block's pages); the first layer's spec
    is the one vLLM's scheduler keeps, the later ones differ from it."""
    if alignment and layout_name.startswith("L"):
        pytest.skip("padded pages of a layer-outermost placement: refused, tested below")
    specs = {
        name: FullAttentionSpec(
            block_size=16, num_kv_heads=h, head_size=16, dtype=torch.float16,
            block_stride_alignment=alignment,
        )
        for name, h in (("a", 2), ("b", 4), ("c", 2), ("d", 1))
    }  # fmt: skip
    worker_config = planned(layout_name, specs)
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])
    pages = 2048 + 4096 + 2048 + 1024
    assert bytes_per_slot(scheduler_config) == bytes_per_slot(worker_config) == pages
    assert tier_sizes(BUDGET, scheduler_config) == tier_sizes(BUDGET, worker_config)
    (scheduler_group,) = kv_layout(scheduler_config, 16).groups
    assert scheduler_group == kv_layout(worker_config, 16).groups[0]
    assert scheduler_group.bytes_per_block == pages
    side = registered_side(worker_config, layout_name)
    try:
        assert side.worker.bytes_per_slot == pages
    finally:
        side.worker.shutdown()


def test_a_hybrid_model_s_groups_of_mixed_pages_share_a_block_alike_in_both_roles() -> None:
    """Full-attention and sliding-window groups, each of mixed pages, alias one
    block-outermost allocation (vLLM places mixed pages of several groups only so)."""
    full = {n: spec(h) for n, h in (("a", 2), ("b", 4))}
    window = {
        n: SlidingWindowSpec(
            block_size=16, num_kv_heads=h, head_size=16, dtype=torch.float16, sliding_window=64
        )
        for n, h in (("c", 4), ("d", 1))
    }
    worker_config = planned("BLHNC", full, window)
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])
    assert bytes_per_slot(scheduler_config) == bytes_per_slot(worker_config) == 2048 + 4096
    scheduler_layout = kv_layout(scheduler_config, 16)
    assert scheduler_layout == kv_layout(worker_config, 16)
    assert [g.bytes_per_block for g in scheduler_layout.groups] == [2048 + 4096, 4096 + 1024]
    assert scheduler_layout.groups[1].sliding_window == 64
    side = registered_side(worker_config, "BLHNC")
    try:
        assert side.worker.bytes_per_slot == 2048 + 4096
    finally:
        side.worker.shutdown()


def test_padded_layer_outermost_pages_of_other_sizes_are_refused_by_the_worker() -> None:
    """A layer-outermost block stride of another layer's spec is its page rounded up to
    the spec's alignment: the scheduler cannot tell the page from it, so the worker,
    which sees both, refuses rather than let the roles size the tiers differently."""
    specs = {
        name: FullAttentionSpec(
            block_size=16, num_kv_heads=h, head_size=16, dtype=torch.float16,
            block_stride_alignment=1000,
        )
        for name, h in (("a", 2), ("b", 4))
    }  # fmt: skip
    worker_config = planned("LBNHC", specs)
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])
    assert bytes_per_slot(scheduler_config) == 2048 + 5000  # "b"'s stride, not its page
    with pytest.raises(
        UnsupportedLayoutError,
        match=r"KV cache group 0 merges layers .*hold 6144 B.* of 7048 B.*BLHNC",
    ):
        WorkerSide(worker_config, BUDGET, LAYOUT, ())


def test_a_group_of_one_page_size_is_sized_alike_in_both_roles() -> None:
    """Layers of equal pages but different head shapes: both roles' slots agree."""
    specs = {"a": spec(2), "b": spec(1, head_size=32)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    config = uniform_config()
    config.kv_cache_groups = [KVCacheGroupSpec(["a", "b"], uniform)]
    config.kv_cache_tensors[1] = KVCacheTensor(
        NUM_BLOCKS * 4096, ["b"], NUM_BLOCKS * 2048, 2048, NUM_BLOCKS * 2048
    )
    scheduler_config = generate_scheduler_kv_cache_config([config])
    assert tier_sizes(BUDGET, config) == tier_sizes(BUDGET, scheduler_config) == {Tier.CPU: 256}


def test_a_hisparse_host_group_is_refused_by_both_roles_at_start_up() -> None:
    """HiSparse's source group lives in a host pool of its own block ids; copied by
    block id from the device allocation it would store other blocks' bytes. It used to
    pass start-up and fail only at `register_kv_caches` (KV tensors "outside the shared
    KV allocation"); the scheduler role never refused it."""
    device = one_layer_config()
    host_spec = spec(1)
    host_page = host_spec.page_size_bytes
    host = KVCacheTensor(64 * host_page, ["src"], 64 * host_page, host_page, 0, True)
    config = KVCacheConfig(
        NUM_BLOCKS,
        [host, *device.kv_cache_tensors],
        [KVCacheGroupSpec(["src"], host_spec, host_resident=True), *device.kv_cache_groups],
        hisparse_host_num_blocks=64,
    )
    named = r"KV cache group 0 \(layers \['src'\]\) lives in HiSparse"
    with pytest.raises(UnsupportedLayoutError, match=named):
        tier_sizes(BUDGET, config)  # the scheduler role's sizing
    with pytest.raises(UnsupportedLayoutError, match="HiSparse"):
        WorkerSide(config, BUDGET, LAYOUT, ())
