"""vLLM's pool, request, KV cache config and events seen through kvtier's types."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from block_span import bytes_per_block_id
from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm_harness import HarnessConfig, VllmHarness

from kvtier.adapters.vllm.events import EventTranslator, vllm_medium
from kvtier.adapters.vllm.layout import (
    UnsupportedLayoutError,
    group_kind,
    kv_layout,
)
from kvtier.adapters.vllm.views import VllmGpuPoolView, VllmRequestView
from kvtier.core.events import AllCleared, BlockRemoved, BlockStored
from kvtier.core.keys import key_block_hash, key_group_id, make_key
from kvtier.core.kv_groups import GroupKind

HASH = bytes(range(32))


@pytest.mark.parametrize("group_id", [0, 1, 258, 2**32 - 1])
def test_vllm_keys_are_kvtier_keys(group_id: int) -> None:
    vllm_key = make_block_hash_with_group_id(HASH, group_id)
    assert make_key(HASH, group_id) == vllm_key
    assert (key_block_hash(vllm_key), key_group_id(vllm_key)) == (HASH, group_id)


def cached_pool() -> tuple[VllmBlockPool, list[int]]:
    """A vLLM pool with blocks 1-3 cached (keys of group 1) and freed in that order."""
    pool = VllmBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool._insert_block_hash(
            make_block_hash_with_group_id(HASH[:-1] + bytes([i]), 1), block, num_tokens=16
        )
    pool.free_blocks(blocks)
    return pool, [b.block_id for b in blocks]


def test_gpu_pool_view_reads_blocks_and_keys() -> None:
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    block = view.block(ids[1])
    assert (block.block_id, block.ref_count, block.is_null) == (ids[1], 0, False)
    assert block.key == make_key(HASH[:-1] + bytes([1]), 1)
    assert block.num_tokens == 16
    assert view.cached_block(block.key) == ids[1]
    assert view.cached_block(make_key(HASH, 0)) is None
    assert view.block(0).is_null
    extra = make_block_hash_with_group_id(HASH, 1)
    pool._insert_block_hash(extra, pool.blocks[ids[1]], num_tokens=None)
    assert list(view.block(ids[1]).secondary_keys) == [extra]


def test_gpu_pool_view_names_every_block_of_a_hash_cached_twice() -> None:
    """vLLM caches a hash twice when two requests computed it; `cached_blocks` names both
    (an unconfirmed finish holds back every block of a dropped position's key)."""
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    key = view.block(ids[1]).key
    assert key is not None
    assert view.cached_blocks(key) == [ids[1]]
    (again,) = pool.get_new_blocks(1)
    pool._insert_block_hash(key, again, num_tokens=16)
    assert sorted(view.cached_blocks(key)) == sorted([ids[1], again.block_id])
    assert view.cached_blocks(make_key(HASH, 0)) == []


def test_gpu_pool_view_touch_free_and_free_queue_order() -> None:
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    # Unhashed free blocks sit at the head, then the cached ones in the order freed.
    order = list(view.iter_free_after(None))
    assert order[-3:] == ids
    assert list(view.iter_free_after(ids[0])) == ids[1:]
    assert list(view.iter_free_after(0)) == order  # the null block is never free: the head
    view.touch([ids[0]])
    assert pool.blocks[ids[0]].ref_cnt == 1
    assert (view.block(ids[0]).ref_count, view.block(ids[1]).ref_count) == (1, 0)
    assert list(view.iter_free_after(ids[0])) == order[:-3] + ids[1:]  # busy: from the head
    view.free([ids[0]])
    assert list(view.iter_free_after(None))[-1] == ids[0]  # back at the MRU end


def test_gpu_pool_view_takes_and_drops_a_reference_on_every_block_in_order() -> None:
    """`touch` takes one reference on each block named and `free` drops them in the order
    given: vLLM evicts in the order blocks were freed, which kvtier's order decides."""
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    view.touch(ids)
    assert [pool.blocks[i].ref_cnt for i in ids] == [1, 1, 1]
    assert not set(ids) & set(view.iter_free_after(None))
    order = [ids[2], ids[0], ids[1]]
    view.free(order)
    assert [pool.blocks[i].ref_cnt for i in ids] == [0, 0, 0]
    assert list(view.iter_free_after(None))[-3:] == order


def test_gpu_pool_view_discards_the_keys_of_the_blocks_named_only() -> None:
    """A failed load's blocks lose their keys in vLLM's prefix cache, a referenced one
    included (it stays with its request), so vLLM serves none of them; others keep theirs."""
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    keys = view.keys(ids)
    view.touch([ids[2]])
    view.discard_keys_of([ids[0], ids[2]])
    assert view.keys(ids) == [None, keys[1], None]
    assert [view.cached_block(key) for key in keys if key] == [None, ids[1], None]
    assert pool.blocks[ids[2]].ref_cnt == 1
    view.discard_keys_of([])
    assert view.cached_block(keys[1]) == ids[1]


@pytest.mark.parametrize("slots", [True, False])
def test_gpu_pool_view_free_after_is_iter_free_after_with_keys(slots: bool) -> None:
    """Lazy mode's one-pass walk lists what `iter_free_after` yields, cut at `limit`, with
    what `keys` reads (None for the unhashed head), free or busy cursor, either read."""
    pool, ids = cached_pool()
    view = VllmGpuPoolView(pool, (16, 16))
    assert view._slots  # vLLM 0.33's blocks: the slot read; False reads the properties
    view._slots = slots
    pool.touch([pool.blocks[ids[1]]])  # busy: walks from it start at the head
    for cursor in (None, ids[0], ids[1], ids[2]):
        listed = list(view.iter_free_after(cursor))
        for limit in (0, 2, len(listed), len(listed) + 5):
            expected = listed[:limit]
            assert view.free_after(cursor, limit) == (expected, view.keys(expected))
    walked, keys = view.free_after(None, 100)
    assert walked[-2:] == [ids[0], ids[2]]
    assert keys[-2:] == [pool.blocks[ids[0]].block_hash, pool.blocks[ids[2]].block_hash]
    assert None in keys


def test_request_view_reads_a_live_vllm_request() -> None:
    harness = VllmHarness(HarnessConfig())
    request = harness.add_request("r", list(range(1000, 1040)), max_tokens=2)
    view = VllmRequestView(request)
    assert (view.request_id, view.num_tokens, view.num_prompt_tokens) == ("r", 40, 40)
    assert (view.num_computed_tokens, view.num_output_placeholders) == (0, 0)
    assert list(view.block_hashes) == request.block_hashes
    assert len(view.block_hashes) == 2
    assert list(view.token_ids[:2]) == [1000, 1001]
    assert view.lora is None
    assert not view.skip_prefix_cache
    harness.run()
    assert view.num_tokens == 42  # grows with the request


def spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16
    )


def test_layout_of_the_harness_engine() -> None:
    harness = VllmHarness(HarnessConfig(num_gpu_blocks=64))
    layout = kv_layout(harness.kv_cache_config)
    (group,) = layout.groups
    assert (group.kind, group.block_size, layout.hash_block_size) == (
        GroupKind.FULL_ATTENTION,
        16,
        16,
    )
    assert group.bytes_per_block == 2 * 2048
    assert bytes_per_block_id(harness.kv_cache_config) == 2 * 2048


def test_layout_of_a_hybrid_config() -> None:
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64
    )
    mamba = MambaSpec(
        block_size=64, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    config = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[
            KVCacheTensor(size=10 * 8192, layers=["a"], layer_stride=8192, block_stride=8192)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], spec()),
            KVCacheGroupSpec(["b"], window),
            KVCacheGroupSpec(["c"], mamba),
        ],
        hash_block_size=16,
    )
    layout = kv_layout(config)
    assert [g.kind for g in layout.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW,
        GroupKind.STATE,
    ]
    assert layout.groups[1].sliding_window == 64
    assert (layout.scheduler_block_size, layout.hash_block_size) == (64, 16)
    assert bytes_per_block_id(config) == 8192


def test_mla_specs_keep_their_kind_and_window() -> None:
    """An MLA layer is full attention; a sliding-window MLA layer keeps its window (the
    wrong kind stores blocks vLLM dropped, or loads a window without its prefix)."""
    mla = {"block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(4 * 18432, ["a", "b"], 18432, 2 * 18432)],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], MLAAttentionSpec(**mla)),
            KVCacheGroupSpec(["b"], SlidingWindowMLASpec(**mla, sliding_window=128)),
        ],
        hash_block_size=16,
    )
    groups = kv_layout(config).groups
    assert [(g.kind, g.sliding_window) for g in groups] == [
        (GroupKind.FULL_ATTENTION, None),
        (GroupKind.SLIDING_WINDOW, 128),
    ]


def test_unknown_specs_are_refused() -> None:
    chunked = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16, attention_chunk_size=32
    )
    with pytest.raises(UnsupportedLayoutError, match="chunked"):
        group_kind(chunked)
    with pytest.raises(UnsupportedLayoutError, match="not supported"):
        group_kind(object())


def test_events_translate_to_vllm_classes() -> None:
    translator = EventTranslator.for_vllm(VllmHarness(HarnessConfig()).kv_cache_config)
    assert translator.group_spec_kinds == ("full_attention",)
    translator = EventTranslator(
        translator.block_stored,
        translator.block_removed,
        translator.convert_hash,
        ("sliding_window", "mamba"),
    )
    stored = translator.translate(
        BlockStored(
            HASH,
            1,
            16,
            parent_block_hash=HASH[::-1],
            token_ids=(1, 2),
            lora_id=3,
            lora_name="l",
            medium="DISK",
            group_kind="full_attention",
            sliding_window=64,
            session_id="s",
        )
    )
    assert isinstance(stored, vllm_events.BlockStored)
    assert stored.block_hashes == [maybe_convert_block_hash(HASH)]
    assert stored.parent_block_hash == maybe_convert_block_hash(HASH[::-1])
    assert (stored.token_ids, stored.block_size, stored.group_idx) == ([1, 2], 16, 1)
    assert (stored.medium, stored.kv_cache_spec_kind, stored.locality) == (
        "STORAGE",
        "mamba",
        "LOCAL",
    )
    assert (stored.lora_id, stored.lora_name, stored.extra_keys) == (3, "l", [None])
    assert (stored.kv_cache_spec_sliding_window, stored.session_id) == (64, "s")
    removed = translator.translate(BlockRemoved(HASH, 0, "CPU"))
    assert isinstance(removed, vllm_events.BlockRemoved)
    assert removed.block_hashes == [maybe_convert_block_hash(HASH)]
    assert (removed.medium, removed.group_idx) == ("CPU", 0)
    (cleared,) = translator.translate_all([AllCleared("CPU", (BlockRemoved(HASH, 0, "CPU"),))])
    assert isinstance(cleared, vllm_events.BlockRemoved)
    assert (cleared.block_hashes, cleared.medium) == ([maybe_convert_block_hash(HASH)], "CPU")
    assert vllm_medium(None) is None


def test_a_uniform_type_sliding_window_group_keeps_its_window() -> None:
    """vLLM merges sliding-window layers of one window but different page sizes into a
    `UniformTypeKVCacheSpecs`, which has no `sliding_window` of its own: reading it there
    raised AttributeError at start-up."""
    specs = {
        name: SlidingWindowSpec(
            block_size=16, num_kv_heads=heads, head_size=16, dtype=torch.float16, sliding_window=64
        )
        for name, heads in (("a", 2), ("b", 4))
    }
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    config = KVCacheConfig(
        num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a", "b"], uniform)]
    )
    (group,) = kv_layout(config, hash_block_size=16).groups
    assert (group.kind, group.sliding_window) == (GroupKind.SLIDING_WINDOW, 64)
    assert group.bytes_per_block == uniform.page_size_bytes
