"""vLLM's `KVCacheConfig` translated into kvtier's `KVLayout` and tier sizing.

vLLM places every KV cache group in one backing allocation; groups alias the same bytes
(a block id belongs to one group at a time). One tier slot must therefore hold every
byte one block id spans in that allocation: `bytes_per_block_id`, not the sum of the
groups' pages. `KVGroupSpec.bytes_per_block` is filled with each group's own page bytes
(its layers' pages), which is what the group's KV occupies.

No vLLM import: specs are recognised by their exact class name, so this module (and the
main test suite) runs without vLLM.
"""

from __future__ import annotations

from typing import Any

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier

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


def _group_spec(group: Any, num_layers: int) -> KVGroupSpec:
    spec = group.kv_cache_spec
    page_bytes = int(spec.page_size_bytes) * num_layers
    if not getattr(group, "enable_kv_transfer", True) or not spec.prefix_cacheable:
        return KVGroupSpec(GroupKind.SCRATCH, int(spec.block_size), page_bytes)
    kind = group_kind(spec)
    window = int(spec.sliding_window) if kind is GroupKind.SLIDING_WINDOW else None
    return KVGroupSpec(kind, int(spec.block_size), page_bytes, sliding_window=window)


def kv_layout(kv_cache_config: Any, hash_block_size: int | None = None) -> KVLayout:
    """Return the `KVLayout` of a vLLM `KVCacheConfig`.

    `hash_block_size` defaults to `kv_cache_config.hash_block_size` (set by vLLM's engine
    core); it must match the granularity of `Request.block_hashes`.
    """
    groups = tuple(
        _group_spec(group, len(group.layer_names)) for group in kv_cache_config.kv_cache_groups
    )
    if hash_block_size is None:
        hash_block_size = kv_cache_config.hash_block_size
    return KVLayout(groups, configured_hash_block_size=hash_block_size)


def bytes_per_block_id(kv_cache_config: Any) -> int:
    """Return the bytes one GPU block id spans in vLLM's KV allocation (one tier slot)."""
    sizes = [int(t.size) for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    if not sizes:
        raise UnsupportedLayoutError("the model has no KV cache tensors on the device")
    return max(sizes) // int(kv_cache_config.num_blocks)


def num_tier_blocks(config: OffloadConfig, kv_cache_config: Any) -> int:
    """Return the tier size both connector roles derive from the same inputs.

    vLLM asks workers for a tier size only for its own offload connector, so the
    scheduler and every worker compute it identically: one slot per GPU block id's bytes,
    as many as the per-rank budget holds (or the explicit `num_blocks`).
    """
    return config.num_tier_blocks(bytes_per_block_id(kv_cache_config))


def tier_sizes(config: OffloadConfig, kv_cache_config: Any) -> dict[Tier, int]:
    """Return the size in blocks of every configured lower tier (CPU and disk in a cascade).

    Derived like `num_tier_blocks`, identically by the scheduler and every worker.
    """
    bytes_per_block = bytes_per_block_id(kv_cache_config)
    return {tier: config.num_tier_blocks(bytes_per_block, tier) for tier in config.tiers}
