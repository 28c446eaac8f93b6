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
