"""The model runner: owns the model and the paged KV cache, runs one forward step."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from kvtier.core.plural import counted
from kvtier.engine.config import CacheConfig, LayerGroup, ModelConfig
from kvtier.engine.model import DecoderModel
from kvtier.engine.paged_attention import AttentionMetadata, first_key_position, kv_cache_shape
from kvtier.offload.host import total_memory_bytes

logger = logging.getLogger(__name__)


class KVCacheTooLargeError(ValueError):
    """The paged KV cache asked for cannot fit this machine's memory (on the CPU device)."""

    def __init__(self, num_blocks: int, detail: str) -> None:
        super().__init__(f"EngineConfig.num_gpu_blocks={num_blocks}: {detail}")
        self.num_blocks = num_blocks
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        # ValueError's own would call __init__(message).
        return type(self), (self.num_blocks, self.detail)


def check_kv_cache_fits(config: ModelConfig, cache: CacheConfig, device: torch.device) -> None:
    """Raise `KVCacheTooLargeError` when a CPU-device KV cache exceeds this machine's memory.

    On the CPU device the engine's "GPU" pool is host memory: a pool above it would be
    killed by the kernel while it is zeroed, or fail deep inside torch. A CUDA device
    reports its own out-of-memory error, naming the device.
    """
    if device.type != "cpu":
        return
    need = cache.num_blocks * cache.block_size * config.kv_bytes_per_token()
    memory = total_memory_bytes()
    if memory is not None and need > memory:
        raise KVCacheTooLargeError(
            cache.num_blocks,
            f"the KV cache needs {need} bytes ({counted(cache.num_blocks, 'block')} x "
            f"{counted(cache.block_size, 'token')} x {config.kv_bytes_per_token()} bytes), more "
            f"than this machine's memory or its container's limit ({memory} bytes); on the CPU "
            "device the GPU pool is host memory",
        )


class LogitsSelection(enum.Enum):
    """Which tokens `ModelRunner.run` returns logits for."""

    LAST = "last"  # one row per sequence: its last new token
    ALL = "all"  # one row per new token, in batch order


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's work in a step.

    `token_ids` are computed at positions `num_cached_tokens`, `num_cached_tokens + 1`, …;
    the earlier positions' K/V must already be in the cache. `block_tables[g]` is the
    sequence's block table in KV group g; it must cover every new token, and every block
    a new token may attend to must be a real (non-null) block. Those blocks must be
    distinct, and a block the step writes (one holding a new token) must not be among
    the blocks any other sequence of the batch reads or writes: sequences may share only
    blocks that are already full. Ids and counts are ints (numpy integers too): `run`
    refuses a float, which a tensor would truncate into another valid id.
    """

    token_ids: tuple[int, ...]
    num_cached_tokens: int
    block_tables: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        """Return the sequence length after this step."""
        return self.num_cached_tokens + len(self.token_ids)


@dataclass(frozen=True)
class BatchInput:
    """The sequences of one forward step."""

    sequences: tuple[SequenceInput, ...]


class ModelRunner:
    """Own a `DecoderModel` and its per-layer KV cache; run forward steps on its device.

    `kv_tensors[i]` is layer i's cache, [2, num_blocks, block_size, num_kv_heads, head_dim]
    (K then V), allocated once and never reallocated, so the offload worker can register
    them. Block ids are per KV group: group g's ids index the caches of its layers.
    """

    def __init__(self, model: DecoderModel, cache_config: CacheConfig) -> None:
        self.model = model
        self.config = model.config
        self.cache_config = cache_config
        self.layer_groups: tuple[LayerGroup, ...] = self.config.layer_groups()
        self.device = next(model.parameters()).device
        check_kv_cache_fits(self.config, cache_config, self.device)
        shape = kv_cache_shape(
            cache_config.num_blocks,
            cache_config.block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
        )
        self.kv_tensors: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.config.dtype, device=self.device)
            for _ in range(self.config.num_layers)
        ]
        logger.info(
            "KV cache: %d layers x %d blocks x %d tokens, %.1f MiB",
            self.config.num_layers,
            cache_config.num_blocks,
            cache_config.block_size,
            sum(t.nbytes for t in self.kv_tensors) / 2**20,
        )

    @property
    def block_size(self) -> int:
        """Return the tokens per block (the same in every group)."""
        return self.cache_config.block_size

    def group_kv_tensors(self, group_id: int) -> list[torch.Tensor]:
        """Return the KV tensors of the layers of group `group_id`, in layer order."""
        return [self.kv_tensors[i] for i in self.layer_groups[group_id].layer_ids]

    def bytes_per_block(self, group_id: int) -> int:
        """Return the bytes one block of group `group_id` holds over all its layers (K + V)."""
        return sum(t.nbytes for t in self.group_kv_tensors(group_id)) // (
            self.cache_config.num_blocks
        )

    @torch.inference_mode()
    def run(
        self, batch: BatchInput, selection: LogitsSelection = LogitsSelection.LAST
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing their K/V; return float32 logits.

        Rows follow `selection`: one per sequence (its last new token) or one per new token.
        """
        self._check_batch(batch)
        seqs = batch.sequences
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat(
            [torch.arange(s.num_cached_tokens, s.num_tokens, dtype=torch.int64) for s in seqs]
        )
        metadata = [self._group_metadata(batch, group, positions) for group in self.layer_groups]
        hidden = self.model(
            input_ids.to(self.device), positions.to(self.device), self.kv_tensors, metadata
        )
        if selection is LogitsSelection.LAST:
            ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
            hidden = hidden[ends.to(self.device)]
        return self.model.compute_logits(hidden)

    def _group_metadata(
        self, batch: BatchInput, group: LayerGroup, positions: torch.Tensor
    ) -> AttentionMetadata:
        block_size = self.block_size
        tables = [s.block_tables[group.group_id] for s in batch.sequences]
        width = max(len(t) for t in tables)
        padded = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        seq_index = torch.repeat_interleave(
            torch.arange(len(tables)), torch.tensor([len(s.token_ids) for s in batch.sequences])
        )
        slot_mapping = padded[seq_index, positions // block_size] * block_size + (
            positions % block_size
        )
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            block_tables=padded.to(self.device),
            num_cached_tokens=tuple(s.num_cached_tokens for s in batch.sequences),
            num_new_tokens=tuple(len(s.token_ids) for s in batch.sequences),
        )

    def _check_batch(self, batch: BatchInput) -> None:
        if not batch.sequences:
            raise ValueError("empty batch")
        num_groups = len(self.layer_groups)
        for index, seq in enumerate(batch.sequences):
            if type(seq.num_cached_tokens) is not int:
                _require_ints([seq.num_cached_tokens], f"sequence {index}: num_cached_tokens")
            if not seq.token_ids or seq.num_cached_tokens < 0:
                raise ValueError(
                    f"sequence {index}: {len(seq.token_ids)} new tokens after "
                    f"{seq.num_cached_tokens} cached ones; need >= 1 new and >= 0 cached"
                )
            if seq.num_tokens > self.config.max_position:
                raise ValueError(
                    f"sequence {index}: {seq.num_tokens} tokens exceed "
                    f"max_position={self.config.max_position}"
                )
            bad_ids = _outside(seq.token_ids, self.config.vocab_size, f"sequence {index}: token id")
            if bad_ids:
                raise ValueError(f"sequence {index}: token ids {bad_ids[:5]} outside the vocab")
            if len(seq.block_tables) != num_groups:
                raise ValueError(
                    f"sequence {index}: {len(seq.block_tables)} block tables for "
                    f"{num_groups} KV groups"
                )
        for group in self.layer_groups:
            touched = [self._check_block_table(i, s, group) for i, s in enumerate(batch.sequences)]
            if len(touched) > 1:
                self._check_no_shared_writes(batch, group, touched)

    def _check_block_table(self, index: int, seq: SequenceInput, group: LayerGroup) -> set[int]:
        """Check one table; return the ids of the blocks the step reads or writes."""
        table = seq.block_tables[group.group_id]
        first_block = first_key_position(seq.num_cached_tokens, group.sliding_window)
        first_block //= self.block_size
        end_block = -(-seq.num_tokens // self.block_size)
        where = f"sequence {index}, group {group.group_id}"
        if len(table) < end_block:
            raise ValueError(
                f"{where}: block table has {len(table)} blocks, {seq.num_tokens} tokens "
                f"need {end_block}"
            )
        needed = table[first_block:end_block]
        if 0 in needed:
            raise ValueError(
                f"{where}: null block in blocks {first_block}..{end_block - 1}, which the "
                f"step reads or writes: {needed}"
            )
        if _outside(table, self.cache_config.num_blocks, f"{where}: block id"):
            raise ValueError(
                f"{where}: block ids outside 0..{self.cache_config.num_blocks - 1}: {table}"
            )
        touched = set(needed)
        if len(touched) < len(needed):
            # Two positions in one block: one's K/V would overwrite or stand in for the other's.
            repeated = next(b for b in needed if needed.count(b) > 1)
            raise ValueError(
                f"{where}: block {repeated} appears more than once in blocks "
                f"{first_block}..{end_block - 1}, which the step reads or writes: {needed}"
            )
        return touched

    def _check_no_shared_writes(
        self, batch: BatchInput, group: LayerGroup, touched: list[set[int]]
    ) -> None:
        """Raise if a block one sequence writes is read or written by another one."""
        users: dict[int, list[int]] = {}
        for index, blocks in enumerate(touched):
            for block in blocks:
                users.setdefault(block, []).append(index)
        for index, seq in enumerate(batch.sequences):
            table = seq.block_tables[group.group_id]
            end_block = -(-seq.num_tokens // self.block_size)
            for block in table[seq.num_cached_tokens // self.block_size : end_block]:
                others = [i for i in users[block] if i != index]
                if others:
                    raise ValueError(
                        f"sequence {index}, group {group.group_id}: block {block}, which the "
                        f"step writes, is also used by sequence {others[0]} in the same step"
                    )


def _outside(values: Sequence[Any], end: int, what: str) -> list[Any]:
    """Return the ids in `values` outside [0, end); raise TypeError naming `what` and the
    first that is not an int (a float would be truncated into a valid id: 1.9 read as 1).

    One type test per id on the way (Python ints, as the engine passes them); numpy
    integers are accepted too."""
    suspects = [v for v in values if type(v) is not int or not 0 <= v < end]
    if not suspects:
        return suspects
    _require_ints(suspects, what)
    return [v for v in suspects if not 0 <= v < end]


def _require_ints(values: Sequence[Any], what: str) -> None:
    """Raise TypeError naming `what` and the first of `values` that is not an integer
    (a bool is not one)."""
    for value in values:
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise TypeError(f"{what} {value!r} is not an int")
