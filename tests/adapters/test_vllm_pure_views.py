"""The vLLM adapter's views of vLLM's requests and GPU block pool, without vLLM (stand-ins
with vLLM's attribute names; test_vllm_translation.py covers the real classes)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.adapters.vllm.views import (
    VllmGpuPoolView,
    VllmRequestView,
    reads_hash_slots,
    tokens_in_block,
)
from kvtier.core.keys import make_key

HASH = bytes(range(32))


def test_request_view_reads_through() -> None:
    lora = SimpleNamespace(lora_int_id=3, lora_name="adapter")
    request = SimpleNamespace(
        request_id="r",
        num_tokens=40,
        num_prompt_tokens=38,
        num_computed_tokens=16,
        num_output_placeholders=1,
        block_hashes=[HASH],
        all_token_ids=list(range(40)),
        lora_request=lora,
        skip_reading_prefix_cache=True,
    )
    view = VllmRequestView(request)
    assert (view.request_id, view.num_tokens, view.num_prompt_tokens) == ("r", 40, 38)
    assert (view.num_computed_tokens, view.num_output_placeholders) == (16, 1)
    assert view.lora is not None
    assert (view.lora.lora_id, view.lora.lora_name) == (3, "adapter")
    assert view.skip_prefix_cache
    assert list(view.block_hashes) == [HASH]
    request.num_computed_tokens = 32
    assert view.num_computed_tokens == 32


def extra_keys_request(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "request_id": "r",  # the view reads it once, when it is made
        "mm_features": [],
        "lora_request": None,
        "prompt_embeds": None,
        "cache_salt": None,
    }
    return SimpleNamespace(**{**base, **fields})


def test_a_request_with_no_extras_has_no_extra_keys_without_asking_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path of the token check and of events: no per-block call into vLLM (its
    module made unimportable, so this holds where vLLM is installed too)."""
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_utils", None)
    view = VllmRequestView(extra_keys_request(cache_salt="salt"))
    assert view.block_extra_keys(16, 32) == ()  # the salt goes into block 0 only
    assert VllmRequestView(extra_keys_request()).block_extra_keys(0, 16) == ()


@pytest.mark.parametrize(
    "fields",
    [
        {"cache_salt": "salt"},
        {"lora_request": SimpleNamespace(lora_name="a", lora_path="/p", lora_int_id=1)},
    ],
    ids=["salt", "lora"],
)
def test_a_request_with_extras_gets_vllms_own_extra_keys(fields: dict[str, Any]) -> None:
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    request = extra_keys_request(**fields)
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(request, 0, 16, 0)
    assert keys
    assert VllmRequestView(request).block_extra_keys(0, 16) == tuple(keys)


@pytest.mark.parametrize(
    ("group_id", "end", "expected"),
    [
        (0, 64, 16),  # block 3 of 16-token blocks: vLLM counts 64 tokens of prefix
        (0, 53, 5),  # a partial entry 5 tokens into its block
        (0, 16, 16),
        (1, 96, 32),  # group 1 has 32-token blocks
        (1, 80, 16),
        (0, None, 0),  # vLLM recorded no count
        (0, 0, 0),  # nor a zero count: none, as the batched `token_counts` read it
    ],
)
def test_tokens_in_block_counts_the_blocks_own_tokens(
    group_id: int, end: int | None, expected: int
) -> None:
    block = SimpleNamespace(block_hash=make_key(HASH, group_id), block_hash_num_tokens=end)
    assert tokens_in_block(block, (16, 32)) == expected
    if group_id == 0:
        assert tokens_in_block(block, (16,)) == expected


def test_pool_view_refuses_missing_block_sizes() -> None:
    pool = SimpleNamespace(blocks=[])
    with pytest.raises(ValueError, match="block_sizes"):
        VllmGpuPoolView(pool, ())
    with pytest.raises(ValueError, match="block_sizes"):
        VllmGpuPoolView(pool, (16, 0))


def test_pool_view_passes_keys_through_unchanged() -> None:
    key, tail = make_key(HASH, 1), make_key(HASH[::-1], 1)
    blocks = [
        SimpleNamespace(
            block_id=i, ref_cnt=0, block_hash=None, block_hash_num_tokens=None, is_null=i == 0
        )
        for i in range(4)
    ]
    blocks[2].block_hash, blocks[2].block_hash_num_tokens = key, 48  # vLLM: prefix tokens
    pool = SimpleNamespace(
        blocks=blocks,
        cached_block_hashes_by_block={2: {tail}},
        cached_block_hash_to_block=SimpleNamespace(
            get_one_block=lambda k: blocks[2] if k in (key, tail) else None
        ),
    )
    view = VllmGpuPoolView(pool, (32, 16))  # group 1: 16-token blocks
    block = view.block(2)
    assert (block.key, block.num_tokens, list(block.secondary_keys)) == (key, 16, [tail])
    assert (view.cached_block(tail), view.cached_block(make_key(HASH, 0))) == (2, None)
    assert (view.block(1).key, view.block(1).secondary_keys) == (None, [])
    assert (view.key(2), view.num_tokens(2), list(view.secondary_keys(2))) == (key, 16, [tail])
    assert (view.key(1), view.num_tokens(1), view.secondary_keys(1)) == (None, 0, [])
    assert view.token_counts([2, 1, 2]) == [16, 0, 16]
    assert VllmGpuPoolView(pool, (16,)).token_counts([2, 1]) == [16, 0]  # one-group path
    assert view.secondary_keys_of([1, 2, 3]) == {2: [tail]}
    pool.cached_block_hashes_by_block = {}
    assert view.secondary_keys_of([1, 2, 3]) == {}


def test_batched_reads_of_vllm_blocks_read_their_slots_as_the_properties_do() -> None:
    """`keys` and `token_counts` read vLLM's `KVCacheBlock` slots directly: the same
    values as its properties; stand-in blocks (no slots) are read through the names."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    blocks = [kv_cache_utils.KVCacheBlock(i) for i in range(4)]
    blocks[2].set_block_hash(make_key(HASH, 0), 48)
    blocks[3].set_block_hash(make_key(HASH[::-1], 0), 53)  # a partial entry
    assert reads_hash_slots(blocks)
    assert not reads_hash_slots([SimpleNamespace(block_hash=None, block_hash_num_tokens=None)])
    for sizes in ((16,), (16, 16)):  # the one-group path and the general one
        view = VllmGpuPoolView(SimpleNamespace(blocks=blocks), sizes)
        ids = [3, 1, 2, 3]
        assert view.keys(ids) == [blocks[i].block_hash for i in ids]
        assert view.token_counts(ids) == [5, 0, 16, 5]


def test_token_counts_count_each_group_s_blocks_with_its_own_block_size() -> None:
    """A hybrid model's groups may have blocks of different sizes (16 and 32 tokens): the
    batched `token_counts` reads each key's group, as `num_tokens` does."""
    blocks = [SimpleNamespace(block_hash=None, block_hash_num_tokens=None) for _ in range(4)]
    blocks[1].block_hash, blocks[1].block_hash_num_tokens = make_key(HASH, 0), 48
    blocks[2].block_hash, blocks[2].block_hash_num_tokens = make_key(HASH, 1), 96
    blocks[3].block_hash, blocks[3].block_hash_num_tokens = make_key(HASH[::-1], 1), 72
    view = VllmGpuPoolView(SimpleNamespace(blocks=blocks), (16, 32))
    ids = [1, 2, 3, 0]
    assert view.token_counts(ids) == [16, 32, 8, 0]
    assert [view.num_tokens(i) for i in ids] == [16, 32, 8, 0]


class ComputedHashBlock:
    """A block whose hash properties are computed: no `_block_hash` slot to read."""

    def __init__(self, key: bytes, end: int) -> None:
        self.held = (key, end)

    @property
    def block_hash(self) -> bytes:
        return self.held[0]

    @property
    def block_hash_num_tokens(self) -> int:
        return self.held[1]


class HalfSlottedBlock:
    """`block_hash` a property over its slot; `block_hash_num_tokens` a plain slot."""

    __slots__ = ("_block_hash", "block_hash_num_tokens")

    def __init__(self, key: bytes, end: int) -> None:
        self._block_hash, self.block_hash_num_tokens = key, end

    @property
    def block_hash(self) -> bytes:
        return self._block_hash


class SlotsBesideTheNames:
    """Slots named like vLLM's beside plain `block_hash` attributes (no properties): the
    slots may hold anything (here: stale values), the names are what the block says."""

    __slots__ = ("_block_hash", "_block_hash_num_tokens", "block_hash", "block_hash_num_tokens")

    def __init__(self, key: bytes, end: int) -> None:
        self.block_hash, self.block_hash_num_tokens = key, end
        self._block_hash, self._block_hash_num_tokens = None, None


@pytest.mark.parametrize("block_type", [ComputedHashBlock, HalfSlottedBlock, SlotsBesideTheNames])
def test_batched_reads_of_other_blocks_go_through_the_names(block_type: type) -> None:
    """The slots are read only where both names are properties over them (vLLM 0.33's
    `KVCacheBlock`); any other block is read through its names, as the view says."""
    blocks = [block_type(make_key(HASH, 0), 53), block_type(make_key(HASH[::-1], 0), 32)]
    assert not reads_hash_slots(blocks)
    view = VllmGpuPoolView(SimpleNamespace(blocks=blocks), (16,))
    assert view.keys([1, 0]) == [make_key(HASH[::-1], 0), make_key(HASH, 0)]
    assert view.token_counts([1, 0]) == [16, 5]


def mm_item(identifier: str, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


LORA = SimpleNamespace(lora_name="a", lora_path="/p", lora_int_id=1)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"cache_salt": "salt"},
        {"lora_request": LORA},
        {"lora_request": LORA, "cache_salt": "salt"},
        # Items in later blocks only (none in blocks 0 and 1), one spanning three blocks.
        {"mm_features": [mm_item("img", 40, 30), mm_item("aud", 70, 2), mm_item("v", 100, 5)]},
        {"mm_features": [mm_item("img", 60, 8)], "lora_request": LORA, "cache_salt": "salt"},
        {"prompt_embeds": "embeds"},  # see below: per-block digests
    ],
    ids=["plain", "salt", "lora", "lora-salt", "mm", "mm-lora-salt", "embeds"],
)
def test_a_request_s_blocks_extra_keys_at_once_are_each_block_s(fields: dict[str, Any]) -> None:
    """Lazy events note a finished request's extra keys for its whole table at once: each
    block's are what `block_extra_keys` says of it, at every position (an item or an
    embedding beyond the first blocks included)."""
    pytest.importorskip("vllm.v1.core.kv_cache_utils")
    request = extra_keys_request(**fields)
    if "prompt_embeds" in fields:
        torch = pytest.importorskip("torch")
        request.prompt_embeds = torch.arange(8 * 16 * 2, dtype=torch.float32).reshape(-1, 2)
        request._prompt_embeds_per_block_hashes = {}
    view = VllmRequestView(request)
    each = [view.block_extra_keys(16 * i, 16 * (i + 1)) for i in range(8)]
    assert view.blocks_extra_keys(16, 8) == each
    assert view.blocks_extra_keys(16, 1) == each[:1]
    assert view.blocks_extra_keys(16, 0) == []
    if "mm_features" in fields:
        assert all(each[2:5])  # the items' blocks have keys
