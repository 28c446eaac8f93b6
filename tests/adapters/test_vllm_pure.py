"""The vLLM adapter's translation modules without vLLM (they run in the main venv too).

vLLM objects are replaced by stand-ins with the same attribute names; the real classes
are covered by test_vllm_translation.py in the vLLM venv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from block_span import bytes_per_block_id

from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.adapters.vllm.events import EventTranslator, vllm_medium
from kvtier.adapters.vllm.layout import (
    UnsupportedLayoutError,
    bytes_per_slot,
    check_direct_io,
    group_kind,
    kv_layout,
    num_tier_blocks,
    stage_slot_bytes,
    tier_sizes,
)
from kvtier.adapters.vllm.regions import PlacementError, is_block_compact, placement_block_views
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored
from kvtier.core.kv_groups import GroupKind
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier

HASH = bytes(range(32))


# ----------------------------------------------------------------- stand-in specs


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 16
    page_size_bytes: int = 1024
    prefix_cacheable: bool = True
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int = 16
    page_size_bytes: int = 1024
    sliding_window: int = 64
    prefix_cacheable: bool = True


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = 64
    page_size_bytes: int = 1024
    prefix_cacheable: bool = True


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    kv_cache_specs: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    page_size_bytes: int = 1024
    prefix_cacheable: bool = True


class PatchedFullAttentionSpec(FullAttentionSpec):
    """A subclass: may keep different positions, so it must not pass as its base."""


def group(layers: list[str], spec: Any) -> SimpleNamespace:
    return SimpleNamespace(layer_names=layers, kv_cache_spec=spec, enable_kv_transfer=True)


def placement(layers: list[str], layer_stride: int, block_stride: int, size: int) -> Any:
    return SimpleNamespace(
        size=size,
        layers=layers,
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=0,
        host_resident=False,
    )


def kv_config(groups: list[Any], tensors: list[Any], num_blocks: int = 8) -> Any:
    return SimpleNamespace(
        kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=num_blocks, hash_block_size=16
    )


# ----------------------------------------------------------------- layout


def test_layout_kinds_windows_and_scratch_groups() -> None:
    scratch = group(["d"], FullAttentionSpec(prefix_cacheable=False))
    untransferred = group(["e"], FullAttentionSpec())  # vLLM: not for KV connectors
    untransferred.enable_kv_transfer = False
    config = kv_config(
        [group(["a"], FullAttentionSpec()), group(["b", "c"], SlidingWindowSpec()), scratch],
        [placement(["a"], 1024, 1024, 8 * 1024)],
    )
    config.kv_cache_groups.append(untransferred)
    layout = kv_layout(config)
    kinds = [g.kind for g in layout.groups]
    assert kinds == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, *[GroupKind.SCRATCH] * 2]
    assert layout.groups[1].sliding_window == 64
    assert layout.groups[1].bytes_per_block == 2 * 1024  # two layers' pages
    assert bytes_per_block_id(config) == 1024


def test_a_uniform_type_group_s_block_bytes_are_its_layers_pages_summed() -> None:
    """vLLM's `UniformTypeKVCacheSpecs.page_size_bytes` already sums its layers' pages;
    multiplied by the layer count again, the group's bytes per block came out doubled."""
    specs = {"a": FullAttentionSpec(), "b": FullAttentionSpec(page_size_bytes=2048)}
    uniform = UniformTypeKVCacheSpecs(specs, page_size_bytes=1024 + 2048)
    layout = kv_layout(kv_config([group(["a", "b"], uniform)], []))
    assert layout.groups[0].bytes_per_block == 1024 + 2048


def test_a_uniform_type_sliding_window_group_takes_its_layers_window() -> None:
    """The wrapper has no `sliding_window`; its layers share one (vLLM merges no others)."""
    specs = {"a": SlidingWindowSpec(), "b": SlidingWindowSpec(page_size_bytes=2048)}
    uniform = UniformTypeKVCacheSpecs(specs, page_size_bytes=1024 + 2048)
    (window_group,) = kv_layout(kv_config([group(["a", "b"], uniform)], [])).groups
    assert (window_group.kind, window_group.sliding_window) == (GroupKind.SLIDING_WINDOW, 64)
    two_windows = {"a": SlidingWindowSpec(), "b": SlidingWindowSpec(sliding_window=32)}
    mixed = UniformTypeKVCacheSpecs(two_windows)
    with pytest.raises(UnsupportedLayoutError, match=r"mixes sliding windows \[32, 64\]"):
        kv_layout(kv_config([group(["a", "b"], mixed)], []))


def test_specs_are_matched_by_exact_class() -> None:
    assert group_kind(MambaSpec()) is GroupKind.STATE
    uniform = UniformTypeKVCacheSpecs({"a": FullAttentionSpec(), "b": FullAttentionSpec()})
    assert group_kind(uniform) is GroupKind.FULL_ATTENTION
    with pytest.raises(UnsupportedLayoutError, match="PatchedFullAttentionSpec"):
        group_kind(PatchedFullAttentionSpec())
    with pytest.raises(UnsupportedLayoutError, match="mixes"):
        group_kind(UniformTypeKVCacheSpecs({"a": FullAttentionSpec(), "b": MambaSpec()}))
    with pytest.raises(UnsupportedLayoutError, match="chunked"):
        group_kind(FullAttentionSpec(attention_chunk_size=32))


def test_tier_size_is_one_slot_per_block_id() -> None:
    tensors = [placement(["a"], 0, 4096, 10 * 4096)]
    spec = FullAttentionSpec(page_size_bytes=4096)
    config = kv_config([group(["a"], spec)], tensors, num_blocks=10)
    assert num_tier_blocks(OffloadConfig(cpu_bytes=100 * 4096 + 4095), config) == 100
    assert num_tier_blocks(OffloadConfig(cpu_bytes=4096 * 8, num_blocks=5), config) == 5
    cascade = OffloadConfig(
        cpu_bytes=4096 * 8, disk_bytes=4096 * 20, disk_path="/tmp", num_blocks=5
    )
    assert tier_sizes(cascade, config) == {Tier.CPU: 5, Tier.DISK: 20}
    assert tier_sizes(OffloadConfig(cpu_bytes=4096 * 8), config) == {Tier.CPU: 8}


def test_a_padded_block_id_s_slot_holds_only_its_pages() -> None:
    """vLLM rounds a block-outermost block up to its layers' alignment; the worker's slot
    holds the pages (aliased groups' bytes once), so tiers are sized and direct I/O checked
    by it (test_vllm_padded_blocks.py with vLLM's planner)."""

    def padded(state_offset: int, state_page: int) -> Any:
        tensors = [placement(["a"], 0, 20480, 8 * 20480), placement(["m"], 0, 20480, 8 * 20480)]
        tensors[1].offset = state_offset
        state = group(["m"], MambaSpec(page_size_bytes=state_page))
        return kv_config([group(["a"], FullAttentionSpec(page_size_bytes=2048)), state], tensors)

    config = padded(0, 17000)  # the groups alias from byte 0
    assert (bytes_per_block_id(config), bytes_per_slot(config)) == (20480, 17000)
    assert tier_sizes(OffloadConfig(cpu_bytes=10 * 17000), config) == {Tier.CPU: 10}
    with pytest.raises(ConfigError, match="pages hold 17000 B"):
        tier_sizes(OffloadConfig(disk_bytes=1 << 20, disk_path="/tmp"), config)
    assert bytes_per_slot(padded(4096, 1024)) == 2048 + 1024  # apart: two regions


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"cpu_bytes_to_use": 2 * 4096 * 8, "num_cpu_blocks": 9},
            "num_blocks=9 exceeds what cpu_bytes=32768 holds at 4096 bytes per block (8) "
            "(cpu_bytes is cpu_bytes_to_use / 2 ranks; num_blocks is num_cpu_blocks)",
        ),
        (
            {"cpu_bytes_to_use_per_rank": 4096},
            "cpu_bytes=4096 holds 1 block of 4096 bytes; the tier needs at least 2 (block 0 "
            "is the null block) (cpu_bytes is cpu_bytes_to_use_per_rank)",
        ),
    ],
)
def test_tier_sizing_errors_name_the_simple_offload_keys(extra: dict, message: str) -> None:
    """Regression: these named only kvtier keys the user had not written."""
    tensors = [placement(["a"], 0, 4096, 10 * 4096)]
    spec = FullAttentionSpec(page_size_bytes=4096)
    config = kv_config([group(["a"], spec)], tensors, num_blocks=10)
    translated = offload_config_from_vllm(extra, 2, max_batched_tokens=64, events=False)
    with pytest.raises(ConfigError) as error:
        tier_sizes(translated, config)
    assert str(error.value) == message


def stage_config(layers: list[str], page: int = 1024, num_blocks: int = 8) -> Any:
    """One pipeline stage's config: its layers' pages of a block placed side by side."""
    tensor = placement(layers, num_blocks * page, page, len(layers) * num_blocks * page)
    spec = FullAttentionSpec(page_size_bytes=page)
    return kv_config([group(layers, spec)], [tensor], num_blocks=num_blocks)


def test_pipeline_stages_all_size_their_tier_for_the_largest_stage() -> None:
    stages = (2, 3)  # hidden layers per stage; stage 0's config is the scheduler's
    configs = [stage_config(["l0", "l1"]), stage_config(["l2", "l3", "l4"])]
    budget = OffloadConfig(cpu_bytes=40 * 2 * 1024)  # 40 of stage 0's blocks, 26 of stage 1's
    assert tier_sizes(budget, configs[0]) == {Tier.CPU: 40}  # each stage on its own
    assert [tier_sizes(budget, c, stages) for c in configs] == [{Tier.CPU: 26}] * 2
    with pytest.raises(ConfigError, match="num_blocks=30 exceeds"):
        tier_sizes(OffloadConfig(cpu_bytes=40 * 2 * 1024, num_blocks=30), configs[0], stages)


def test_a_stage_larger_than_its_layer_count_fails_at_start_up() -> None:
    budget = OffloadConfig(cpu_bytes=1 << 20)
    four_kv_layers = stage_config(["a", "b", "c", "d"])  # more KV layers than hidden ones
    with pytest.raises(UnsupportedLayoutError, match="4096 B, more than the 3072 B"):
        tier_sizes(budget, four_kv_layers, (3, 3))
    specs = {"a": FullAttentionSpec(), "b": FullAttentionSpec(page_size_bytes=2048)}
    mixed = kv_config([group(["a", "b"], UniformTypeKVCacheSpecs(specs))], [])
    with pytest.raises(UnsupportedLayoutError, match="pipeline parallelism"):
        stage_slot_bytes(mixed, (2, 2))


def test_a_hybrid_stage_s_slot_bound_takes_its_largest_page() -> None:
    """A stage's slot must hold any of its layers' pages: bounded by the largest group page
    (the smallest would size tier slots a state page overflows)."""
    state = group(["m"], MambaSpec(page_size_bytes=4096))
    hybrid = kv_config([group(["a"], FullAttentionSpec(page_size_bytes=1024)), state], [])
    assert stage_slot_bytes(hybrid, (2, 3)) == [2 * 4096, 3 * 4096]


def test_direct_disk_io_needs_page_aligned_blocks() -> None:
    disk = {"disk_bytes": 1 << 20, "disk_path": "/tmp"}
    unaligned = stage_config(["a", "b", "c"], page=2048)  # 6144 B per block id
    with pytest.raises(ConfigError, match='"disk_io_mode": "page_cache", "disk_direct_io": f'):
        tier_sizes(OffloadConfig(**disk), unaligned)
    page_cache = OffloadConfig(**disk, disk_io_mode=DiskIOMode.PAGE_CACHE)
    assert tier_sizes(page_cache, unaligned) == {Tier.DISK: (1 << 20) // 6144}
    check_direct_io(OffloadConfig(cpu_bytes=1 << 20), 6144)  # no disk tier: nothing to align


# ----------------------------------------------------------------- regions


def layered_cache(layout: str, num_blocks: int = 8, page: int = 64) -> tuple[Any, dict, Any]:
    """Two layers placed layer-outermost (LB..) or block-outermost (BL..)."""
    size = 2 * num_blocks * page
    raw = torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8)
    if layout.startswith("L"):
        layer_stride, block_stride = num_blocks * page, page
    else:
        layer_stride, block_stride = page, 2 * page
    tensor = placement(["l0", "l1"], layer_stride, block_stride, size)
    config = kv_config([group(["l0", "l1"], FullAttentionSpec(page_size_bytes=page))], [tensor])
    config.num_blocks = num_blocks
    views = {
        name: raw.as_strided((num_blocks, page), (block_stride, 1), i * layer_stride).view(
            torch.int16
        )
        for i, name in enumerate(["l0", "l1"])
    }
    return config, views, raw


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_placement_views_alias_each_layers_pages(layout: str) -> None:
    config, tensors, raw = layered_cache(layout)
    views = placement_block_views(config, tensors, layout)
    assert set(views) == {"l0", "l1"}
    for name, view in views.items():
        assert (view.shape, view.dtype) == ((8, 64), torch.uint8)
        assert torch.equal(view, tensors[name].view(torch.uint8))
    views["l1"][3].fill_(7)  # writes land in the engine's allocation
    assert int((raw == 7).sum()) >= 64


def test_placement_refuses_what_cannot_be_copied_as_pages() -> None:
    config, tensors, _ = layered_cache("LBNHC")
    assert not is_block_compact("LHBNC")
    # Not only LBNHC: ROCm's backends that prefer LHBNC support LBHNC, not LBNHC.
    with pytest.raises(PlacementError, match=r"LHBNC.*LBNHC, LBHNC, BLNHC, BLHNC"):
        placement_block_views(config, tensors, "LHBNC")
    with pytest.raises(PlacementError, match="not resolved"):
        placement_block_views(config, tensors, None)
    shifted = dict(tensors, l1=tensors["l0"])
    with pytest.raises(PlacementError, match=r"'l1'.*starts at byte 0"):
        placement_block_views(config, shifted, "LBNHC")
    config.kv_cache_tensors[0].block_stride = 32  # neighbouring blocks' pages would overlap
    with pytest.raises(PlacementError, match="'l0': page of 64 B exceeds the block stride 32 B"):
        placement_block_views(config, tensors, "LBNHC")
    config.kv_cache_tensors[0].block_stride = 64
    config.kv_cache_tensors[0].layer_stride = 10**6
    with pytest.raises(PlacementError, match="outside"):
        placement_block_views(config, tensors, "LBNHC")
    elsewhere = dict(tensors, l1=torch.zeros(8, 32, dtype=torch.int16))
    with pytest.raises(PlacementError, match="outside the shared"):
        placement_block_views(config, elsewhere, "LBNHC")


def test_placement_bounds_are_exact_at_the_last_block() -> None:
    """A view past the allocation would copy bytes that are not KV: the last block's page
    must end inside it (exactly at its end is fine), and two blocks may not overlap. A
    layer handed the whole allocation (in its own dtype) has no start to check."""
    config, tensors, raw = layered_cache("LBNHC")  # 8 blocks of 64 B fill the 1024 B
    assert set(placement_block_views(config, tensors, "LBNHC")) == {"l0", "l1"}
    whole = dict(tensors, l1=raw.view(torch.int16))  # handed the whole allocation: no start
    assert placement_block_views(config, whole, "LBNHC")["l1"].data_ptr() == raw.data_ptr() + 512
    config.num_blocks = 9  # l1's ninth page: one page past the end
    with pytest.raises(PlacementError, match=r"'l1': bytes \[512, 1088\) lie outside the 1024"):
        placement_block_views(config, tensors, "LBNHC")
    config, tensors, _ = layered_cache("BLNHC", num_blocks=2)
    config.kv_cache_tensors[0].block_stride = 48  # block 0's pages run into block 1's
    with pytest.raises(PlacementError, match="'l0': page of 64 B exceeds the block stride 48 B"):
        placement_block_views(config, tensors, "BLNHC")


# ----------------------------------------------------------------- events


def recorder(kind: str) -> Any:
    return lambda **fields: (kind, fields)


TRANSLATOR = EventTranslator(recorder("stored"), recorder("removed"), lambda h: h[-2:], ("mamba",))


def test_events_keep_vllm_field_names_and_media() -> None:
    kind, fields = TRANSLATOR.translate(
        BlockStored(HASH, 0, 16, parent_block_hash=HASH[::-1], token_ids=(1, 2), medium="DISK")
    )
    assert kind == "stored"
    assert fields["block_hashes"] == [HASH[-2:]]
    assert fields["parent_block_hash"] == HASH[::-1][-2:]
    assert (fields["medium"], fields["kv_cache_spec_kind"], fields["locality"]) == (
        "STORAGE",
        "mamba",
        "LOCAL",
    )
    assert (fields["token_ids"], fields["group_idx"], fields["extra_keys"]) == ([1, 2], 0, [None])
    _, fields = TRANSLATOR.translate(BlockStored(HASH, 3, 8, group_kind="state", medium="CPU"))
    assert (fields["kv_cache_spec_kind"], fields["medium"]) == ("state", "CPU")
    assert fields["extra_keys"] is None  # payload-free: made without the request, unknown
    known = [BlockStored(HASH, 0, 16, extra_keys=keys) for keys in ((), ("salt",))]
    assert [TRANSLATOR.translate(e)[1]["extra_keys"] for e in known] == [[None], [("salt",)]]
    assert TRANSLATOR.translate(BlockRemoved(HASH, 1, "CPU"))[1]["medium"] == "CPU"
    # A reset names what the tier held, per group, with its medium (vLLM's clear has none).
    held = (BlockRemoved(HASH, 0, "CPU"), BlockRemoved(HASH[::-1], 1, "CPU"))
    assert TRANSLATOR.translate_all([AllCleared("CPU", held)]) == [
        (
            "removed",
            {"block_hashes": [HASH[-2:]], "medium": "CPU", "group_idx": 0, "locality": "LOCAL"},
        ),
        (
            "removed",
            {
                "block_hashes": [HASH[::-1][-2:]],
                "medium": "CPU",
                "group_idx": 1,
                "locality": "LOCAL",
            },
        ),
    ]
    assert TRANSLATOR.translate_all([AllCleared("CPU")]) == []  # an empty tier: nothing
    with pytest.raises(TypeError, match="use translate_all"):
        TRANSLATOR.translate(AllCleared("CPU"))
    assert vllm_medium("GPU") == "GPU"
    with pytest.raises(TypeError, match="not a kvtier KV event"):
        TRANSLATOR.translate("BlockStored")  # type: ignore[arg-type]


def removed(hashes: list[bytes], medium: str, group_idx: int) -> tuple[str, dict]:
    fields = {"block_hashes": hashes, "medium": medium, "group_idx": group_idx}
    return "removed", {**fields, "locality": "LOCAL"}


def test_removals_name_their_group_and_vllm_s_disk_medium() -> None:
    """A router drops the key of the group and medium a removal names: a disk tier is
    vLLM's "STORAGE" in a reset too, and a reset's groups come out in group order."""
    assert TRANSLATOR.translate(BlockRemoved(HASH, 2, "DISK")) == removed([HASH[-2:]], "STORAGE", 2)
    other = HASH[::-1]
    held = (BlockRemoved(HASH, 1, "DISK"), BlockRemoved(other, 0, "DISK"), BlockRemoved(other, 1))
    assert TRANSLATOR.translate_all([AllCleared("DISK", held)]) == [
        removed([other[-2:]], "STORAGE", 0),
        removed([HASH[-2:], other[-2:]], "STORAGE", 1),
    ]
