"""The harness's fake "GPU" KV cache and the prefix fingerprints it holds (test helper).

`FakeKVCache` is one rank's KV cache laid out as vLLM plans it; `PrefixFingerprints`
gives each token prefix of a request a value (equal prefixes under the same adapter and
cache salt, equal values) that the fake forward writes and the checks read back.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

_FINGERPRINT_MOD = 2_147_483_629  # a prime below 2**31: fingerprints fit in int32
_FINGERPRINT_MUL = 1_000_003


def _next_fingerprint(prev: int, token: int) -> int:
    return (prev * _FINGERPRINT_MUL + token + 1) % _FINGERPRINT_MOD


def request_seed(request: Request) -> int:
    """Return the fingerprint a request's prefixes start from: 0 for a plain request; for
    one with a LoRA adapter (name, path) or a cache salt, what vLLM hashes into its block
    hashes' extra keys, a value of those, so that KV another adapter or salt computed for
    the same tokens reads as another prefix's."""
    lora = request.lora_request
    keys = ((lora.lora_name, lora.lora_path) if lora else None, request.cache_salt)
    if keys == (None, None):
        return 0
    return zlib.crc32(repr(keys).encode()) % _FINGERPRINT_MOD


def chain_fingerprints(prev: int, tokens: Sequence[int]) -> list[int]:
    """Return the fingerprints of a prefix (fingerprint `prev`) extended by `tokens`, one
    token at a time (a speculative step's draft positions, fake_drafter.py)."""
    values = []
    for token in tokens:
        prev = _next_fingerprint(prev, token)
        values.append(prev)
    return values


class KVMismatchError(AssertionError):
    """A position counted as computed holds KV of a different token prefix."""


class PrefixFingerprints:
    """Fingerprint of every token prefix of a request: equal prefixes (and adapter and
    cache salt, `request_seed`), equal values."""

    def __init__(self) -> None:
        self._values: dict[str, list[int]] = {}
        self._guessed: dict[str, dict[int, int]] = {}  # request id -> position -> token

    def upto(
        self, request: Request, num_tokens: int, token_at: Callable[[int], int] | None = None
    ) -> list[int]:
        """Return fingerprints of the prefixes ending at positions `0..num_tokens-1`.

        A position past the request's tokens (an output placeholder of asynchronous
        scheduling: sampled, not yet delivered) takes its token from `token_at`, what the
        model runner sampled there; once vLLM delivers that position, the token must be
        the same (AssertionError otherwise: vLLM and the runner disagree on the prefix).
        """
        request_id = request.request_id
        values = self._values.setdefault(request_id, [])
        token_ids = request.all_token_ids
        guessed = self._guessed.setdefault(request_id, {})
        for pos in [pos for pos in guessed if pos < len(token_ids)]:
            token = guessed.pop(pos)
            assert token_ids[pos] == token, f"{request_id}: position {pos} delivered another token"
        prev = values[-1] if values else request_seed(request)
        for pos in range(len(values), num_tokens):
            if pos < len(token_ids):
                token = token_ids[pos]
            else:
                assert token_at is not None, f"{request_id}: position {pos} has no token yet"
                token = guessed[pos] = token_at(pos)
            prev = _next_fingerprint(prev, token)
            values.append(prev)
        return values[:num_tokens]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's fingerprints."""
        self._values.pop(request_id, None)
        self._guessed.pop(request_id, None)


class FakeKVCache:
    """The "GPU" KV cache of one rank, laid out exactly as `kv_cache_config` places it.

    One zeroed int8 allocation of the planned size; `tensors` are vLLM's own per-layer
    `[B, H, N, C]` views into it (what `register_kv_caches` receives on a GPU), so
    copies by block id and region discovery from the placement behave as on a GPU.
    Token `n` of block `b` holds its prefix fingerprint xor the layer index in the first
    4 content bytes of head 0, and the fingerprint plus the layer index in the last 4
    content bytes of the last head. Each KV cache group maps positions to its blocks with
    its own block size; a sliding-window group needs only the window's last positions.

    A Mamba group in vLLM's "align" mode holds one state per block, not one entry per
    position: the state after the last token a forward computed into that block, which
    is a function of the token prefix. It is modelled as that position's fingerprint, at
    the first and last 4 bytes of the block's page. A forward of positions
    `start..end-1` reads the state of position `start - 1` from block
    `(start - 1) // block_size` and leaves the state of `end - 1` in block
    `(end - 1) // block_size` (vLLM's worker copies one into the other, then the kernel
    advances it in place), so equal prefixes leave equal states.
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        layout = KVCacheLayout[kv_cache_config.kv_cache_layout or "LBNHC"]
        groups = kv_cache_config.kv_cache_groups
        spec_of = {name: g.kv_cache_spec for g in groups for name in g.layer_names}
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self.windows: list[int | None] = [
            getattr(g.kv_cache_spec, "sliding_window", None) for g in groups
        ]
        self.is_state = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        self.raw = torch.zeros(kv_cache_config.kv_cache_tensors[0].size, dtype=torch.int8)
        self.tensors: dict[str, torch.Tensor] = {}
        for placement in kv_cache_config.kv_cache_tensors:
            spec = spec_of[placement.layers[0]]
            views = create_kv_cache_views(
                self.raw, spec, kv_cache_config.num_blocks, layout, placement
            )
            self.tensors.update(zip(placement.layers, views, strict=True))
        index = {name: layer for layer, name in enumerate(self.tensors)}
        # Per group: (layer index, the layer's bytes) of each of its layers.
        self._layers = [
            [(index[name], self.tensors[name].view(torch.int8)) for name in g.layer_names]
            for g in groups
        ]

    @property
    def block_size(self) -> int:
        """Return the block size of a one-group cache."""
        (block_size,) = self.block_sizes
        return block_size

    def copy_blocks(self, copies: Sequence[Any]) -> None:
        """Copy whole blocks in every layer, as vLLM's worker runs a step's
        `kv_cache_block_copies` (`src_block_id` to `dst_block_id`) before its forward."""
        for copy in copies:
            for tensor in self.tensors.values():
                tensor[copy.dst_block_id] = tensor[copy.src_block_id].clone()

    def write(
        self, tables: Sequence[Sequence[int]], start: int, fingerprints: Sequence[int]
    ) -> None:
        """Write `fingerprints[p]` for positions `start..` into each group's blocks
        (`tables[g]`), except where a sliding window left the null block; a state group
        gets the state of the last position (a null block there raises)."""
        end = len(fingerprints)
        for group, table in enumerate(tables):
            size = self.block_sizes[group]
            if self.is_state[group]:
                if end > start:
                    if not _has_block(table, size, end - 1):
                        raise KVMismatchError(f"group {group}: no block for the state of {end - 1}")
                    self._check_or_write(group, table, fingerprints, [end - 1], write=True)
                continue
            positions = [p for p in range(start, len(fingerprints)) if table[p // size] != 0]
            if positions:
                self._check_or_write(group, table, fingerprints, positions, write=True)

    def check(
        self,
        request_id: str,
        tables: Sequence[Sequence[int]],
        fingerprints: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Raise `KVMismatchError` unless every group holds what it needs of the prefix
        `0..num_tokens-1`: every position, a sliding window's last `window - 1`, or a
        state group's state of the last one (what the next forward reads)."""
        for group, table in enumerate(tables):
            window = self.windows[group]
            first = 0 if window is None else max(0, num_tokens - window + 1)
            if self.is_state[group]:
                first = max(0, num_tokens - 1)
            positions = range(first, num_tokens)
            self.check_positions(f"request {request_id}", group, table, fingerprints, positions)

    def check_states(
        self,
        request_id: str,
        tables: Sequence[Sequence[int]],
        fingerprints: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Raise `KVMismatchError` unless every state group's block of position
        `num_tokens - 1` holds its state: what a running request's forward reads."""
        for group, table in enumerate(tables):
            if self.is_state[group] and num_tokens > 0:
                what = f"request {request_id} (running)"
                self.check_positions(what, group, table, fingerprints, [num_tokens - 1])

    def check_positions(
        self,
        what: str,
        group: int,
        table: Sequence[int],
        fingerprints: Sequence[int],
        positions: Sequence[int],
    ) -> None:
        """Raise `KVMismatchError` unless `positions` of one group hold their fingerprints."""
        size = self.block_sizes[group]
        for pos in positions:
            if not _has_block(table, size, pos):
                raise KVMismatchError(f"{what}: group {group} position {pos} has no block")
        if positions:
            self._check_or_write(group, table, fingerprints, list(positions), False, what)

    def _check_or_write(
        self,
        group: int,
        table: Sequence[int],
        fingerprints: Sequence[int],
        positions: list[int],
        write: bool,
        what: str = "",
    ) -> None:
        at = torch.tensor(positions, dtype=torch.long)
        size = self.block_sizes[group]
        blocks = torch.tensor(list(table), dtype=torch.long)[at // size]
        offsets = torch.zeros_like(at) if self.is_state[group] else at % size
        values = torch.tensor([fingerprints[p] for p in positions], dtype=torch.int32)
        for layer, cache in self._layers[group]:
            first, last = _as_bytes(values ^ layer), _as_bytes(values + layer)
            if write:
                cache[blocks, 0, offsets, :4] = first
                cache[blocks, -1, offsets, -4:] = last
                continue
            good = (cache[blocks, 0, offsets, :4] == first).all(1) & (
                cache[blocks, -1, offsets, -4:] == last
            ).all(1)
            if not bool(good.all()):
                i = int((~good).nonzero()[0])
                raise KVMismatchError(
                    f"{what}: position {positions[i]} (group {group}, block {int(blocks[i])}, "
                    f"layer {layer}) holds KV of another prefix"
                )


def _has_block(table: Sequence[int], block_size: int, pos: int) -> bool:
    """Return True when position `pos` lies in a (non-null) block of `table`."""
    return pos // block_size < len(table) and table[pos // block_size] != 0


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """Return int32 `values` as rows of their 4 bytes."""
    return values.contiguous().view(torch.int8).reshape(-1, 4)
