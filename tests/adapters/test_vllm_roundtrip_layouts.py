"""Byte-exact store → scramble → load through the worker role for every placement
vLLM's planner makes that the harness's round trips (one full-attention group, LBNHC
and BLNHC) do not: kernel blocks smaller than the block, pages padded to an alignment,
layers of different page sizes, hybrid groups aliasing one block, Mamba states.

The KV cache is vLLM's own allocation (`allocate_kv_cache`, kernel block sizes
included) and every check reads vLLM's own per-layer views, so kvtier's placement
views are checked against what the attention kernels address: each layer's page of
every destination block must come back, and no other byte vLLM owns may change.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.adapters.vllm.worker_side import WorkerSide
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier, TransferJob, TransferPlan

NUM_BLOCKS = 12
SRC = (1, 2, 3, 7)
SLOTS = (0, 1, 2, 3)
DST = (4, 9, 10, 11)


def attention(num_kv_heads: int = 2, head_size: int = 8, **extra: object) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16,
        **extra,
    )  # fmt: skip


def window(num_kv_heads: int = 2, head_size: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16,
        sliding_window=32,
    )  # fmt: skip


def mla(head_size: int, alignment: int | None = None) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16,
        alignment=alignment,
    )  # fmt: skip


def mamba(page_size_padded: int | None) -> MambaSpec:
    return MambaSpec(
        block_size=16,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page_size_padded,
    )


def uniform(**specs: KVCacheSpec) -> UniformTypeKVCacheSpecs:
    merged = UniformTypeKVCacheSpecs.from_specs(specs)
    assert merged is not None
    return merged


def planned(layout_name: str, *groups: tuple[list[str], KVCacheSpec]) -> KVCacheConfig:
    """The groups placed by vLLM's own planner in `layout_name`, NUM_BLOCKS blocks."""
    layout = KVCacheLayout[layout_name]
    cache_config = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=NUM_BLOCKS,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None), cache_config=cache_config
    )
    specs = [KVCacheGroupSpec(names, spec) for names, spec in groups]
    config = get_kv_cache_config_from_groups(vllm_config, specs, 1 << 30)  # type: ignore[arg-type]
    config.kv_cache_layout = layout_name
    return config


# name -> (layout, groups, kernel block size of each group or None)
CASES = {
    "kernel blocks of 4 tokens (LBHNC)": (
        "LBHNC", [(["a", "b", "c"], attention())], [4],
    ),
    "kernel blocks of 8 tokens (LBNHC)": (
        "LBNHC", [(["a", "b"], attention(head_size=16))], [8],
    ),
    "mixed pages in one group (BLHNC)": (
        "BLHNC", [(["a", "b", "c"], uniform(a=attention(), b=attention(4), c=attention(1)))], None,
    ),
    "mixed pages in one group (LBNHC)": (
        "LBNHC", [(["a", "b", "c"], uniform(a=attention(), b=attention(4), c=attention(1)))], None,
    ),
    "hybrid groups of other pages and layer counts (BLNHC)": (
        "BLNHC", [(["a", "b"], attention()), (["c", "d", "e"], window(num_kv_heads=1))], None,
    ),
    "hybrid groups of one page size (LBHNC)": (
        "LBHNC", [(["a", "b"], attention()), (["c"], window())], None,
    ),
    "blocks padded to their alignment (BLHNC)": (
        "BLHNC", [(["a", "b"], attention(block_stride_alignment=1000)), (["c"], window(4))], None,
    ),
    "pages padded to their alignment (LBNHC)": (
        "LBNHC", [(["a", "b"], attention(block_stride_alignment=768))], None,
    ),
    "MLA pages of other sizes padded (BLHNC)": (
        "BLHNC", [(["a", "b"], mla(24, alignment=576)), (["c"], mla(40, alignment=576))], None,
    ),
    "Mamba states padded to the attention page (LBNHC)": (
        "LBNHC", [(["a", "b"], attention()), (["m1", "m2"], mamba(1024))], None,
    ),
    "Mamba states of their own size (BLNHC)": (
        "BLNHC", [(["a", "b"], attention()), (["m1", "m2"], mamba(None))], None,
    ),
}  # fmt: skip


def page_bytes(kv_caches: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Return each layer's page of `block` as vLLM's views address it, as bytes."""
    pages = {}
    for name, cache in kv_caches.items():
        page = group_kernel_blocks(cache, NUM_BLOCKS)[block].contiguous()
        pages[name] = page.view(-1).view(torch.uint8).clone()
    return pages


def owned_bytes(kv_caches: dict[str, torch.Tensor], size: int) -> torch.Tensor:
    """Return a mask of the bytes of the allocation that some layer's view addresses."""
    owned = torch.zeros(size, dtype=torch.bool)
    for cache in kv_caches.values():
        elem = cache.element_size()
        index = torch.arange(size // elem, dtype=torch.int64)
        reach = torch.as_strided(index, cache.shape, cache.stride(), cache.storage_offset())
        starts = reach.reshape(-1) * elem
        owned[(starts[:, None] + torch.arange(elem)).reshape(-1)] = True
    return owned


def rows_of(side: WorkerSide, blocks: tuple[int, ...], size: int) -> torch.Tensor:
    """Return a mask of the bytes the worker's regions copy for `blocks`."""
    rows = torch.zeros(size, dtype=torch.bool)
    for region in side.worker.regions.regions:
        for block in blocks:
            start = region.offset + block * region.block_stride
            rows[start : start + region.bytes_per_block] = True
    return rows


def run(side: WorkerSide, job: TransferJob, step_id: int) -> None:
    side.worker.submit(TransferPlan(step_id=step_id, jobs=(job,)))
    side.worker.flush()
    report = side.worker.poll()
    assert job.event_id in report.done, f"event {job.event_id} did not finish: {report}"


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_s_placements_round_trip_byte_exact(case: str) -> None:
    layout_name, groups, kernel_block_sizes = CASES[case]
    config = planned(layout_name, *groups)
    kv_caches = allocate_kv_cache(
        config, torch.device("cpu"), KVCacheLayout[layout_name], kernel_block_sizes
    )
    storage = next(iter(kv_caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    side = WorkerSide(config, OffloadConfig(cpu_bytes=1 << 20), layout_name, ())
    side.register_kv_caches(kv_caches)
    try:
        gen = torch.Generator().manual_seed(7)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        originals = [page_bytes(kv_caches, block) for block in SRC]
        run(side, TransferJob(1, Tier.GPU, Tier.CPU, SRC, SLOTS), step_id=1)

        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        before = raw.clone()
        run(side, TransferJob(2, Tier.CPU, Tier.GPU, SLOTS, DST), step_id=2)

        for block, original in zip(DST, originals, strict=True):
            loaded = page_bytes(kv_caches, block)
            for name in kv_caches:
                assert torch.equal(loaded[name], original[name]), f"{name} of block {block}"
        # Expected: the scrambled bytes with the original pages written by vLLM's views.
        after = raw.clone()
        raw.copy_(before)
        for block, original in zip(DST, originals, strict=True):
            for name, cache in kv_caches.items():
                page = group_kernel_blocks(cache, NUM_BLOCKS)[block]
                page.copy_(original[name].view(page.dtype).view(page.shape))
        # Padding inside a padded page belongs to the page (its slot bytes) but to no view.
        padding = ~owned_bytes(kv_caches, raw.numel()) & rows_of(side, DST, raw.numel())
        changed = (raw != after) & ~padding
        assert not bool(changed.any()), f"{int(changed.sum())} bytes outside the pages changed"
    finally:
        side.shutdown()
