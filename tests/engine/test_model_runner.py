"""ModelRunner: chunked prefill, decode, batching and sliding-window null blocks."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from engine_helpers import dense_logits, make_runner, shuffled_tables, step

from kvtier.engine.config import AttentionKind, CacheConfig, ModelConfig
from kvtier.engine.model import build_model
from kvtier.engine.runner import BatchInput, LogitsSelection, ModelRunner, SequenceInput

CONFIGS = {"full": ModelConfig.tiny(), "hybrid": ModelConfig.tiny_hybrid()}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _slots(runner: ModelRunner, table: tuple[int, ...], num_tokens: int) -> list[int]:
    size = runner.block_size
    return [table[p // size] * size + p % size for p in range(num_tokens)]


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_equals_one_shot(name: str) -> None:
    tokens = _tokens(37, seed=1)
    one_shot, chunked = make_runner(CONFIGS[name]), make_runner(CONFIGS[name])
    tables = shuffled_tables(one_shot, [len(tokens)], _gen())[0]
    expected = one_shot.run(BatchInput((step(tokens, 0, tables),)))
    start = 0
    for size in (5, 11, 1, 16, 4):
        logits = chunked.run(BatchInput((step(tokens[start : start + size], start, tables),)))
        start += size
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for group in one_shot.layer_groups:
        slots = _slots(one_shot, tables[group.group_id], len(tokens))
        for layer in group.layer_ids:
            kv_a = one_shot.kv_tensors[layer].view(2, -1, 2, 16)[:, slots]
            kv_b = chunked.kv_tensors[layer].view(2, -1, 2, 16)[:, slots]
            torch.testing.assert_close(kv_b, kv_a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_equal_dense_forward(name: str) -> None:
    runner = make_runner(CONFIGS[name])
    tokens = _tokens(30, seed=2)
    tables = shuffled_tables(runner, [len(tokens)], _gen(1))[0]
    all_logits = runner.run(BatchInput((step(tokens[:22], 0, tables),)), LogitsSelection.ALL)
    expected = dense_logits(runner.model, tokens)
    torch.testing.assert_close(all_logits, expected[:22], atol=1e-5, rtol=1e-5)
    for pos in range(22, 30):
        logits = runner.run(BatchInput((step(tokens[pos : pos + 1], pos, tables),)))
        torch.testing.assert_close(logits[0], expected[pos], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_batch_equals_sequences_alone(name: str) -> None:
    config = CONFIGS[name]
    batched, alone = make_runner(config), make_runner(config)
    spans = [(0, 9), (12, 1), (7, 13), (20, 1)]  # prefills, decodes and a chunk together
    all_tables = shuffled_tables(batched, [c + n for c, n in spans], _gen(3))
    seqs = []
    for i, ((num_cached, num_new), tables) in enumerate(zip(spans, all_tables, strict=True)):
        tokens = _tokens(num_cached + num_new, seed=10 + i)
        if num_cached:  # both runners must start from the same cached prefix
            batched.run(BatchInput((step(tokens[:num_cached], 0, tables),)))
            alone.run(BatchInput((step(tokens[:num_cached], 0, tables),)))
        seqs.append(step(tokens[num_cached:], num_cached, tables))
    logits = batched.run(BatchInput(tuple(seqs)))
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[i], alone.run(BatchInput((seq,)))[0])


def test_sliding_null_blocks_with_nan_garbage_change_nothing() -> None:
    config = ModelConfig.tiny_hybrid()  # window 8, block size 4
    kept, nulled = make_runner(config), make_runner(config)
    tokens = _tokens(40, seed=4)
    tables = shuffled_tables(kept, [len(tokens)], _gen(2))[0]
    prefill = BatchInput((step(tokens[:25], 0, tables),))
    kept.run(prefill)
    nulled.run(prefill)
    sliding = next(g for g in config.layer_groups() if g.kind is AttentionKind.SLIDING)
    expected = dense_logits(kept.model, tokens)
    for pos in range(25, 40):
        # Drop blocks wholly out of the window, as the engine does; poison what it frees.
        first_block = max(0, pos - config.sliding_window + 1) // kept.block_size
        table = list(tables[sliding.group_id])
        for layer in sliding.layer_ids:
            nulled.kv_tensors[layer][:, [0, *table[:first_block]]] = torch.nan
        table[:first_block] = [0] * first_block
        null_tables = (tables[0], tuple(table))
        got = nulled.run(BatchInput((step(tokens[pos : pos + 1], pos, null_tables),)))
        want = kept.run(BatchInput((step(tokens[pos : pos + 1], pos, tables),)))
        assert torch.equal(got, want)
        torch.testing.assert_close(got[0], expected[pos], atol=1e-5, rtol=1e-5)


def test_kv_tensors_layout_and_bytes_per_block() -> None:
    runner = make_runner(ModelConfig.tiny_hybrid(), CacheConfig(block_size=4, num_blocks=10))
    assert [g.layer_ids for g in runner.layer_groups] == [(0,), (1,)]
    assert len(runner.kv_tensors) == 2
    assert runner.kv_tensors[1].shape == (2, 10, 4, 2, 16)
    assert runner.group_kv_tensors(1) == [runner.kv_tensors[1]]
    assert runner.bytes_per_block(0) == runner.bytes_per_block(1) == 2 * 4 * 2 * 16 * 4
    full = make_runner(ModelConfig.tiny(), CacheConfig(block_size=4, num_blocks=10))
    assert full.bytes_per_block(0) == 2 * (2 * 4 * 2 * 16 * 4)


def test_invalid_batches_are_rejected() -> None:
    runner = make_runner(ModelConfig.tiny_hybrid())
    good = ((1, 2), (3, 4))
    cases = [
        (step([1, 2], 0, ((1,), (3,), (5,))), "3 block tables for 2 KV groups"),
        (step([1] * 5, 0, ((1,), (3, 4))), "block table has 1 blocks, 5 tokens need 2"),
        (step([1], 4, ((1, 2), (0, 4))), r"null block in blocks 0\.\.1"),
        (step([1], 4, ((0, 2), (3, 4))), r"group 0: null block"),
        (step([], 0, good), "0 new tokens"),
        (step([999], 0, good), "outside the vocab"),
        (step([1], 0, ((1, 99), (3, 4))), "block ids outside"),
        (step([128], 0, good), r"token ids \[128\] outside the vocab"),  # vocab_size 128
        (step([1], 0, ((1, 64), (3, 4))), r"block ids outside 0\.\.63"),  # 64 blocks
        (step([1], -1, good), "1 new tokens after -1 cached ones"),
    ]
    for seq, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.run(BatchInput((seq,)))
    # A sliding window of 8 at position 12 only needs blocks 1..3: block 0 may be null.
    runner.run(BatchInput((step([1], 12, ((1, 2, 5, 6), (0, 4, 7, 8))),)))


def test_a_sequence_past_max_position_is_rejected() -> None:
    runner = make_runner(dataclasses.replace(ModelConfig.tiny(), max_position=16))
    runner.run(BatchInput((step([1], 15, ((1, 2, 3, 4),)),)))  # position 15: the last
    with pytest.raises(ValueError, match="17 tokens exceed max_position=16"):
        runner.run(BatchInput((step([1], 16, ((1, 2, 3, 4, 5),)),)))


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (step([1.9, 2], 0, ((1,), (3,))), "sequence 0: token id 1.9 is not an int"),
        (step([True, 2], 0, ((1,), (3,))), "sequence 0: token id True is not an int"),
        (step([1, 2], 0, ((1.5,), (3,))), "sequence 0, group 0: block id 1.5 is not an int"),
        (step([1], 4, ((1, 2), (3, 4.0))), "sequence 0, group 1: block id 4.0 is not an int"),
        (step([1], 4.0, ((1, 2), (3, 4))), "sequence 0: num_cached_tokens 4.0 is not an int"),  # type: ignore[arg-type]
    ],
)
def test_non_integer_ids_are_refused(seq: SequenceInput, message: str) -> None:
    """Regression: a float token or block id was truncated into a valid one (1.9 ran as
    token 1, block 1.5 as block 1) and the step computed on silently."""
    runner = make_runner(ModelConfig.tiny_hybrid())
    with pytest.raises(TypeError, match=re.escape(message)):
        runner.run(BatchInput((seq,)))


def test_numpy_integer_ids_are_ids() -> None:
    runner = make_runner(ModelConfig.tiny_hybrid())
    as_int = runner.run(BatchInput((step([1, 2], 4, ((1, 2), (3, 4))),)))
    runner = make_runner(ModelConfig.tiny_hybrid())
    tokens, tables = np.array([1, 2]), np.array([[1, 2], [3, 4]])
    numpy_seq = step(list(tokens), np.int64(4), tuple(tuple(t) for t in tables))  # type: ignore[arg-type]
    assert torch.equal(runner.run(BatchInput((numpy_seq,))), as_int)


def test_repeated_blocks_are_rejected() -> None:
    # Two positions in one block would overwrite each other's K/V, or read the wrong ones.
    runner = make_runner(ModelConfig.tiny_hybrid())  # block size 4, window 8
    with pytest.raises(ValueError, match=r"group 0: block 5 appears more than once"):
        runner.run(BatchInput((step([1] * 8, 0, ((5, 5), (3, 4))),)))
    with pytest.raises(ValueError, match=r"group 1: block 7 appears more than once"):
        runner.run(BatchInput((step([1], 4, ((1, 2), (7, 7))),)))
    # Outside the window the null block may repeat, and blocks nobody reads are not checked.
    runner.run(BatchInput((step([1], 16, ((1, 2, 5, 6, 9), (0, 0, 7, 8, 10))),)))


def test_blocks_written_by_two_sequences_are_rejected() -> None:
    runner = make_runner(ModelConfig.tiny())  # block size 4
    written = step([1, 2], 4, ((1, 2),))  # writes block 2
    with pytest.raises(ValueError, match=r"sequence 0, group 0: block 2, which the step writes"):
        runner.run(BatchInput((written, step([3], 4, ((3, 2),)))))
    with pytest.raises(ValueError, match=r"block 2, which the step writes, is also used by seq"):
        runner.run(BatchInput((step([3], 8, ((3, 2, 4),)), written)))
    # A partly filled block the step writes into (tokens 6, 7 of block 2) counts too.
    with pytest.raises(ValueError, match=r"sequence 0, group 0: block 2, which the step writes"):
        runner.run(BatchInput((step([5, 6], 6, ((1, 2),)), step([3], 8, ((3, 2, 4),)))))
    # A full block both only read is a shared prefix: allowed.
    runner.run(BatchInput((step([1, 2], 4, ((1, 2),)), step([3], 4, ((1, 3),)))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CONFIGS)
def test_cuda_runner_matches_cpu(name: str) -> None:
    config, cache = CONFIGS[name], CacheConfig(block_size=4, num_blocks=64)
    tokens = _tokens(28, seed=5)
    results = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(build_model(config, device), cache)
        assert all(t.device.type == device for t in runner.kv_tensors)
        tables = shuffled_tables(runner, [len(tokens)], _gen(4))[0]
        logits = [runner.run(BatchInput((step(tokens[:20], 0, tables),)), LogitsSelection.ALL)]
        for pos in range(20, 28):
            logits.append(runner.run(BatchInput((step(tokens[pos : pos + 1], pos, tables),))))
        results.append(torch.cat(logits).cpu())
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
