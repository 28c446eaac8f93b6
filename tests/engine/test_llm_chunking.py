"""Prefill chunks that fit the pool: a request alone is cut into smaller chunks, and a
sliding-window group gives back out-of-window blocks after every chunk.

Regression: a sliding-window request that validation accepted failed at its first step
("no progress possible") with the default token budget, though it ran when chunked.
"""

from __future__ import annotations

import random

import pytest

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def _generate(engine: EngineConfig, offload: OffloadConfig | None = None) -> list[int]:
    """Greedy tokens of one 160-token prompt on the tiny hybrid model (window 8)."""
    prompt = [random.Random(0).randrange(128) for _ in range(160)]
    with LLM(ModelConfig.tiny_hybrid(), kv_offload=offload, engine=engine) as llm:
        return list(llm.generate([prompt], PARAMS)[0].output_token_ids)


@pytest.mark.parametrize("offload", [None, OffloadConfig(cpu_bytes=1 << 20)], ids=["off", "cpu"])
def test_a_whole_prompt_chunk_that_does_not_fit_is_cut(offload: OffloadConfig | None) -> None:
    """13 usable blocks of 16 tokens: 160 tokens in one chunk need 10 + 10 blocks, but
    its last step needs 10 + 2. The same tokens come out as with a small token budget."""
    chunked = _generate(EngineConfig(num_gpu_blocks=14, max_num_batched_tokens=32))
    assert _generate(EngineConfig(num_gpu_blocks=14), offload) == chunked


def _first_token_alone(
    prompt: list[int], engine: EngineConfig, max_tokens: int, max_steps: int = 300
) -> tuple[int, ...] | str:
    """Serve `prompt` alone: its tokens, or "stuck" when the engine says no progress."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with LLM(ModelConfig.tiny_hybrid(), engine=engine) as llm:
        llm.add_request(prompt, params)
        for _ in range(max_steps):
            try:
                finished = llm.step()
            except RuntimeError as exc:
                if "no progress possible" not in str(exc):
                    raise
                return "stuck"
            if finished:
                return tuple(finished[0].output_token_ids)
    raise AssertionError(f"neither finished nor refused within {max_steps} steps (a loop)")


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("budget", [8, 512])
def test_a_request_alone_finishes_or_is_refused_never_loops(block_size: int, budget: int) -> None:
    """Regression: a chunk was cut a whole block at a time, skipping the lengths that need
    no new block; a request alone then preempted itself every step, forever. Now every
    request alone in a tight pool finishes with the tokens of a large pool, or the
    engine says no progress is possible (its peak need exceeds the pool)."""
    rng = random.Random(block_size * 1000 + budget)
    for num_tokens in range(5, 26, 4):
        prompt = [rng.randrange(128) for _ in range(num_tokens)]
        for max_tokens in (1, 3):
            large = EngineConfig(block_size=block_size, num_gpu_blocks=64)
            expected = _first_token_alone(prompt, large, max_tokens)
            for num_blocks in range(4, 12):
                engine = EngineConfig(
                    block_size=block_size, num_gpu_blocks=num_blocks,
                    max_num_batched_tokens=budget,
                )  # fmt: skip
                try:
                    got = _first_token_alone(prompt, engine, max_tokens)
                except ValueError:
                    continue  # refused up front: it can never fit
                assert got in ("stuck", expected), (num_tokens, max_tokens, num_blocks)
