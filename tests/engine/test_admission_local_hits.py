"""Admission with local GPU prefix hits (SPEC §2.2), no offload: the blocks another
request left cached in the pool, in full-attention and sliding-window layouts."""

from __future__ import annotations

import dataclasses

from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import FinishReason, SamplingParams

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def run(llm: LLM, prompt: list[int], params: SamplingParams) -> Request:
    """Add `prompt` and step until it finishes; return its request."""
    request = llm.add_request(prompt, params)
    while llm.scheduler.has_unfinished():
        llm.step()
    return request


def test_a_prompt_cached_whole_still_computes_its_last_token() -> None:
    """Blocks of 4: an 8-token prompt ran, its 2 full blocks cached. The same prompt again
    hits its first block only (4 tokens): the last prompt token is computed, to sample
    from, and it samples what the first did.
    Mutation: the local hit could cover the whole prompt (a step of 0 new tokens: the
    runner refused it, ValueError)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=9))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = run(llm, list(range(8)), params)
    again = run(llm, list(range(8)), params)
    assert (first.num_local_tokens_total, again.num_local_tokens_total) == (0, 4)
    assert again.output_token_ids == first.output_token_ids
    assert llm.pool.num_free() == llm.pool.num_usable_blocks


def test_a_lone_windowed_request_with_free_hit_blocks_runs_a_chunk_that_fits() -> None:
    """Sliding-window layers only (window 8, blocks of 4), 4 usable blocks: a 9-token
    prompt ran, its 2 full blocks cached and free. A 20-token prompt sharing its 8 tokens
    hits them; with its 12 other tokens in one chunk it needs 2 + 3 blocks, more than the
    pool, though 3 fresh ones alone fit the free 4 (the hit blocks are among them). Alone,
    it runs the 8 tokens that fit beside its hit, then the rest, and finishes.
    Mutation: the hit blocks in the free queue left out of the check for a smaller chunk
    (it was never admitted: "no progress possible", aborted)."""
    model = dataclasses.replace(
        ModelConfig.tiny(),
        layer_kinds=(AttentionKind.SLIDING, AttentionKind.SLIDING),
        sliding_window=8,
    )
    llm = LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    run(llm, list(range(9)), ONE)
    assert llm.pool.num_free() == 4
    request = llm.add_request([*range(8), *range(100, 112)], ONE)
    llm.step()
    assert (request.num_computed_tokens, request.num_local_tokens_total) == (16, 8)
    assert llm.step() == [request]
    assert request.finish_reason is FinishReason.LENGTH
    assert llm.pool.num_free() == 4
