"""Paged forward steps of random chunkings, batchings and prefix hits equal a dense forward.

A tiny random model (full, hybrid or all-sliding, windows and block sizes from 1 up,
grouped-query heads) runs several sequences split into random chunks, batched in random
groupings. A later sequence may reuse an earlier one's leading blocks (a prefix hit,
computing only its own suffix). Sliding-window blocks wholly out of the next query's
window are nulled in the table and poisoned with NaN, as the engine frees them, and so
are the slots before the window in its first block (masked, so any garbage). Every
new token's logits must equal those of a dense single-request forward (`dense_logits`).
"""

from __future__ import annotations

import dataclasses

import torch
from engine_helpers import dense_logits
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.engine.config import AttentionKind, CacheConfig, LayerGroup, ModelConfig
from kvtier.engine.model import build_model
from kvtier.engine.paged_attention import first_key_position
from kvtier.engine.runner import BatchInput, LogitsSelection, ModelRunner, SequenceInput

FULL, SLIDING = AttentionKind.FULL, AttentionKind.SLIDING
NUM_BLOCKS = 96


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    tables: list[list[int]]  # per group
    done: int  # tokens computed (or hit)
    chunks: list[int]


@st.composite
def _configs(draw: st.DrawFn) -> ModelConfig:
    kinds = draw(st.sampled_from([(FULL, FULL), (FULL, SLIDING), (SLIDING, FULL), (SLIDING,) * 2]))
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    return dataclasses.replace(
        ModelConfig.tiny(),
        num_kv_heads=num_kv_heads,
        layer_kinds=kinds,
        sliding_window=draw(st.integers(1, 9)) if SLIDING in kinds else None,
    )


def _null_out_of_window(runner: ModelRunner, seq: _Seq, seqs: list[_Seq]) -> None:
    """Null `seq`'s sliding blocks before its next token's window; poison those no other
    sequence still holds (a shared block stays, as its reference count keeps it)."""
    for group in runner.layer_groups:
        if group.sliding_window is None:
            continue
        first_key = max(0, seq.done - group.sliding_window + 1)
        table = seq.tables[group.group_id]
        for index in range(first_key // runner.block_size):
            block, table[index] = table[index], 0
            if block and not any(block in s.tables[group.group_id] for s in seqs):
                for layer in group.layer_ids:
                    runner.kv_tensors[layer][:, block] = torch.nan
        # Slots before the window in its first block are garbage too.
        first_block, num_dead = divmod(first_key, runner.block_size)
        block = table[first_block] if first_block < len(table) else 0
        if num_dead and block and not any(block in s.tables[group.group_id] for s in seqs):
            for layer in group.layer_ids:
                runner.kv_tensors[layer][:, block, :num_dead] = torch.nan


@settings(max_examples=scaled_examples(40), deadline=None)
@given(config=_configs(), block_size=st.integers(1, 5), data=st.data())
def test_random_paged_steps_equal_dense_forward(
    config: ModelConfig, block_size: int, data: st.DataObject
) -> None:
    runner = ModelRunner(build_model(config, seed=3), CacheConfig(block_size, NUM_BLOCKS))
    num_groups = len(runner.layer_groups)
    free = [list(range(NUM_BLOCKS - 1, 0, -1)) for _ in range(num_groups)]
    seqs: list[_Seq] = []
    for _ in range(data.draw(st.integers(1, 3), label="num_seqs")):
        tokens = data.draw(st.lists(st.integers(0, 127), min_size=1, max_size=22))
        tables: list[list[int]] = [[] for _ in range(num_groups)]
        done = 0
        if seqs:
            donor = seqs[data.draw(st.integers(0, len(seqs) - 1), label="donor")]
            shared = data.draw(st.integers(0, donor.done // block_size), label="hit")
            tokens = donor.tokens[: shared * block_size] + tokens
            done = shared * block_size if shared * block_size < len(tokens) else 0
            # A hit needs the donor's blocks in every group, the sliding ones in its window.
            tables = [list(t[: done // block_size]) for t in donor.tables]
            if done and any(0 in t[_first_block(runner, g, done) :] for g, t in
                            zip(runner.layer_groups, tables, strict=True)):  # fmt: skip
                done, tables = 0, [[] for _ in range(num_groups)]
        need = -(-len(tokens) // block_size)
        for group_tables, group_free in zip(tables, free, strict=True):
            group_tables.extend(group_free.pop() for _ in range(need - len(group_tables)))
        chunks = []
        left = len(tokens) - done
        while left:
            chunks.append(data.draw(st.integers(1, left), label="chunk"))
            left -= chunks[-1]
        seqs.append(_Seq(tokens, tables, done, chunks))
        # Run the new sequence's first chunk with the earlier ones, so a hit reads a prefix
        # computed by an earlier step; the rest run in random groupings below.
        _run_step(runner, [seqs[-1]], seqs)
    while pending := [s for s in seqs if s.chunks]:
        picked = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique_by=id))
        _run_step(runner, picked, seqs)


def _first_block(runner: ModelRunner, group: LayerGroup, num_cached: int) -> int:
    return first_key_position(num_cached, group.sliding_window) // runner.block_size


def _run_step(runner: ModelRunner, picked: list[_Seq], seqs: list[_Seq]) -> None:
    inputs = []
    for seq in picked:
        others = [s for s in seqs if s is not seq]
        _null_out_of_window(runner, seq, others)
        size = seq.chunks.pop(0)
        inputs.append(
            SequenceInput(
                tuple(seq.tokens[seq.done : seq.done + size]),
                seq.done,
                tuple(tuple(t) for t in seq.tables),
            )
        )
    logits = runner.run(BatchInput(tuple(inputs)), LogitsSelection.ALL)
    row = 0
    for seq, step_input in zip(picked, inputs, strict=True):
        size = len(step_input.token_ids)
        expected = dense_logits(runner.model, seq.tokens)[seq.done : seq.done + size]
        torch.testing.assert_close(logits[row : row + size], expected, atol=1e-5, rtol=1e-5)
        row += size
        seq.done += size
