"""vLLM's `KVCacheConfig` translated into kvtier's `KVLayout` and tier sizing.

vLLM places every KV cache group in one backing allocation; groups alias the same bytes
(a block id belongs to one group at a time). One tier slot must therefore hold every
page of one block id in that allocation, aliased bytes once: `bytes_per_slot`, not the
sum of the groups' pages, and not the padding vLLM may add to align a block (the
span of a block id in the allocation counts it). `KVGroupSpec.bytes_per_block` is filled with each
group's own page bytes (its layers' pages), which is what the group's KV occupies. Under
pipeline parallelism each stage holds its own layers, so its slots hold different bytes:
every rank sizes its tiers for the largest stage (`tier_sizes`), so all agree on the slot
count.

No vLLM import: specs are recognised by their exact class name, so this module (and the
main test suite) runs without vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kvtier.adapters.vllm.regions import PlacementError, layer_page_bytes, placement_slot_bytes
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig, agree_num_tier_blocks
from kvtier.offload.plan import Tier
from kvtier.storage.slot_file import DIRECT_IO_ALIGNMENT

# Exact class names: a subclass may change which positions it keeps (e.g. R-SWA drops
# decode gaps) and must be mapped deliberately, not inherited by accident.
_KIND_BY_SPEC: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "MLAAttentionSpec": GroupKind.FULL_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "SlidingWindowMLASpec": GroupKind.SLIDING_WINDOW,
    "MambaSpec": GroupKind.STATE,
}
_UNIFORM_SPECS = "UniformTypeKVCacheSpecs"


class UnsupportedLayoutError(ValueError):
    """A KV cache group has a spec kvtier cannot store and load correctly."""


def group_kind(spec: Any) -> GroupKind:
    """Return kvtier's kind for a vLLM group spec; raise for specs kvtier cannot serve."""
    name = type(spec).__name__
    if name == _UNIFORM_SPECS:
        kinds = {group_kind(inner) for inner in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise UnsupportedLayoutError(f"group mixes KV kinds {sorted(k.value for k in kinds)}")
        return kinds.pop()
    kind = _KIND_BY_SPEC.get(name)
    if kind is None:
        raise UnsupportedLayoutError(
            f"KV cache spec {name} is not supported by kvtier; disable the connector for this model"
        )
    if kind is GroupKind.FULL_ATTENTION and getattr(spec, "attention_chunk_size", None):
        raise UnsupportedLayoutError("chunked local attention is not supported by kvtier")
    return kind


def block_level_failures(kv_cache_config: Any) -> bool:
    """Return True when vLLM takes load failures by GPU block (`invalid_block_ids`) for
    this layout: one KV cache group, of full attention.

    vLLM's `Scheduler._handle_invalid_blocks` raises with more than one group (block ids
    repeat across groups), and a sliding window or a state at a shorter prefix would need
    blocks the load never wrote; those layouts report failed requests whole.
    """
    groups = kv_cache_config.kv_cache_groups
    return len(groups) == 1 and group_kind(groups[0].kv_cache_spec) is GroupKind.FULL_ATTENTION


def _group_spec(group: Any, pages: dict[str, int]) -> KVGroupSpec:
    spec = group.kv_cache_spec
    page_bytes = int(spec.page_size_bytes)  # a UniformTypeKVCacheSpecs sums its layers'
    if type(spec).__name__ != _UNIFORM_SPECS:  # maybe one layer's of one (scheduler role)
        page_bytes = sum(pages[name] for name in group.layer_names)
    if not getattr(group, "enable_kv_transfer", True) or not spec.prefix_cacheable:
        return KVGroupSpec(GroupKind.SCRATCH, int(spec.block_size), page_bytes)
    kind = group_kind(spec)
    window = _sliding_window(spec) if kind is GroupKind.SLIDING_WINDOW else None
    return KVGroupSpec(kind, int(spec.block_size), page_bytes, sliding_window=window)


def _sliding_window(spec: Any) -> int:
    """Return a sliding-window spec's window; a `UniformTypeKVCacheSpecs` has none of
    its own, only its layers' (vLLM merges only layers of one window)."""
    if type(spec).__name__ != _UNIFORM_SPECS:
        return int(spec.sliding_window)
    windows = {_sliding_window(inner) for inner in spec.kv_cache_specs.values()}
    if len(windows) != 1:
        raise UnsupportedLayoutError(f"group mixes sliding windows {sorted(windows)}")
    return windows.pop()


def kv_layout(kv_cache_config: Any, hash_block_size: int | None = None) -> KVLayout:
    """Return the `KVLayout` of a vLLM `KVCacheConfig`.

    `hash_block_size` defaults to `kv_cache_config.hash_block_size` (set by vLLM's engine
    core); it must match the granularity of `Request.block_hashes`.
    """
    pages = layer_page_bytes(kv_cache_config)
    groups = tuple(_group_spec(group, pages) for group in kv_cache_config.kv_cache_groups)
    if hash_block_size is None:
        hash_block_size = kv_cache_config.hash_block_size
    return KVLayout(groups, configured_hash_block_size=hash_block_size)


def bytes_per_slot(kv_cache_config: Any) -> int:
    """Return the bytes of one tier slot: the pages of one GPU block id, without the
    padding vLLM adds when it rounds a block-outermost block up to its layers'
    `block_stride_alignment` (exactly what the worker's regions hold)."""
    try:
        return placement_slot_bytes(kv_cache_config)
    except PlacementError as error:
        raise UnsupportedLayoutError(str(error)) from error


def num_tier_blocks(config: OffloadConfig, kv_cache_config: Any) -> int:
    """Return the size of the first lower tier (see `tier_sizes`; no pipeline stages)."""
    return tier_sizes(config, kv_cache_config)[config.tier]


def tier_sizes(
    config: OffloadConfig, kv_cache_config: Any, stage_layers: Sequence[int] = ()
) -> dict[Tier, int]:
    """Return the size in blocks of every configured lower tier (CPU and disk in a cascade).

    vLLM asks workers for a tier size only for its own offload connector, so the
    scheduler and every worker derive it identically, each from its own
    `kv_cache_config`: slots of a GPU block id's pages (`bytes_per_slot`), as many as
    the per-rank budget holds (or the explicit `num_blocks`).

    `stage_layers` holds the hidden layers of each pipeline stage as vLLM splits them
    (empty without pipeline parallelism). The stages' slots hold different bytes,
    and the scheduler sees only stage 0's config, so every rank then sizes the tiers for
    the largest stage (`stage_slot_bytes`): the same slot count everywhere, within every
    rank's budget. Raises `ConfigError` / `UnsupportedLayoutError` at start-up when this
    rank's blocks cannot be stored as configured.
    """
    check_device_resident(kv_cache_config)
    check_scheduler_agrees(kv_cache_config)
    own_bytes = bytes_per_slot(kv_cache_config)
    check_direct_io(config, own_bytes)
    per_stage = [own_bytes]
    if len(stage_layers) > 1:
        per_stage = stage_slot_bytes(kv_cache_config, stage_layers)
        if own_bytes > max(per_stage):
            raise UnsupportedLayoutError(
                f"a KV block id of this pipeline stage holds {own_bytes} B, more than the "
                f"{max(per_stage)} B kvtier sizes tier slots for (the largest stage's "
                f"{max(stage_layers)} layers x one layer's page): kvtier cannot size its "
                "tier for this model under pipeline parallelism"
            )
    return {
        tier: agree_num_tier_blocks([config.num_tier_blocks(b, tier) for b in per_stage])
        for tier in config.tiers
    }


def check_device_resident(kv_cache_config: Any) -> None:
    """Raise `UnsupportedLayoutError` when a KV cache group that takes part in KV
    transfer lives in HiSparse's host pool (`host_resident`).

    Its block ids count that pool's blocks, not the device allocation's that a tier slot
    copies: stored by block id, they would copy other blocks' bytes. Checked in both
    roles at start-up; the worker would otherwise only fail at `register_kv_caches`,
    on KV tensors outside the device allocation.
    """
    groups = kv_cache_config.kv_cache_groups
    hosted = [
        i
        for i, group in enumerate(groups)
        if getattr(group, "host_resident", False) and getattr(group, "enable_kv_transfer", True)
    ]
    if hosted:
        raise UnsupportedLayoutError(
            f"{_groups_named(hosted)} (layers {list(groups[hosted[0]].layer_names)[:3]}) "
            f"{'lives' if len(hosted) == 1 else 'live'} in HiSparse's host pool "
            "(host_resident), whose block ids are not the device KV cache's: kvtier cannot "
            "store them; disable HiSparse or the connector"
        )


def check_scheduler_agrees(kv_cache_config: Any) -> None:
    """Raise `UnsupportedLayoutError` when vLLM's scheduler role would size other tier
    slots than this worker's `kv_cache_config` holds.

    vLLM hands the scheduler a copy in which a `UniformTypeKVCacheSpecs` group holds only
    its first layer's spec (`generate_scheduler_kv_cache_config`); the other layers'
    pages are then read from their placements (`regions.layer_page_bytes`), which cannot
    tell a layer-outermost page from the padding its spec's alignment added. Only a
    worker sees both, so it builds the same copy and refuses at start-up on a mismatch.
    """
    groups = kv_cache_config.kv_cache_groups
    uniform = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == _UNIFORM_SPECS]
    if not uniform:
        return
    view = copy.copy(kv_cache_config)
    view.kv_cache_groups = [_as_scheduler_sees(group) for group in groups]
    own, seen = bytes_per_slot(kv_cache_config), bytes_per_slot(view)
    if own != seen:
        raise UnsupportedLayoutError(
            f"{_groups_named(uniform)} {'merges' if len(uniform) == 1 else 'merge'} layers "
            "of different specs: this worker's "
            f"tier slots hold {own} B, but vLLM's scheduler sees one layer's spec of "
            f"each and kvtier's scheduler role would size slots of {seen} B (a "
            "layer-outermost placement pads some pages to their alignment); use a "
            "block-outermost layout (VLLM_KV_CACHE_LAYOUT=BLHNC or BLNHC) or disable "
            "the connector for this model"
        )


def _as_scheduler_sees(group: Any) -> Any:
    """Return `group` as vLLM's scheduler gets it: a UniformTypeKVCacheSpecs replaced
    by its first layer's spec (`generate_scheduler_kv_cache_config`)."""
    spec = group.kv_cache_spec
    if type(spec).__name__ != _UNIFORM_SPECS:
        return group
    seen = copy.copy(group)
    seen.kv_cache_spec = next(iter(spec.kv_cache_specs.values()))
    return seen


def stage_slot_bytes(kv_cache_config: Any, stage_layers: Sequence[int]) -> list[int]:
    """Return the most bytes a tier slot can hold on each pipeline stage.

    Every rank computes the same list: vLLM gives all stages the same KV cache groups
    and specs (only the layer names differ), so one layer's page is the same everywhere,
    and a stage holds at most one KV layer per hidden layer. Exact for models with one
    kind of attention; an upper bound for hybrid models, whose groups share pages.
    """
    pages = []
    for group in kv_cache_config.kv_cache_groups:
        if getattr(group, "host_resident", False):
            continue
        spec = group.kv_cache_spec
        if type(spec).__name__ == _UNIFORM_SPECS:
            # The scheduler sees only stage 0's first layer spec: the stages could differ.
            raise UnsupportedLayoutError(
                "layers with different KV page sizes (UniformTypeKVCacheSpecs) are not "
                "supported by kvtier under pipeline parallelism"
            )
        pages.append(int(spec.page_size_bytes))
    if not pages:
        raise UnsupportedLayoutError("the model has no KV cache groups on the device")
    return [num_layers * max(pages) for num_layers in stage_layers]


def check_direct_io(config: OffloadConfig, slot_bytes: int) -> None:
    """Raise `ConfigError` when the disk tier's direct I/O cannot hold `slot_bytes`.

    O_DIRECT moves whole 4096-byte pages, so a slot must be a multiple of them; checked
    at start-up in both roles rather than when the worker opens its file.
    """
    disk_io = config.disk_bytes > 0 and config.disk_io_mode is DiskIOMode.DIRECT
    if disk_io and slot_bytes % DIRECT_IO_ALIGNMENT:
        raise ConfigError(
            f"the disk tier's direct I/O needs blocks of a multiple of {DIRECT_IO_ALIGNMENT} "
            f"bytes, but one KV block id's pages hold {slot_bytes} B: use the page cache in "
            'kv_connector_extra_config, with the key that chose direct I/O: "disk_io_mode": '
            '"page_cache", "disk_direct_io": false, or (SimpleCPUOffloadConnector\'s keys) '
            '"use_page_cache": true'
        )


def _groups_named(group_ids: list[int]) -> str:
    """Return "KV cache group 0" or "KV cache groups [0, 2]", for messages."""
    if len(group_ids) == 1:
        return f"KV cache group {group_ids[0]}"
    return f"KV cache groups {group_ids}"
