"""Admission with a tier hit on a hybrid model: a sliding-window group holds only the
blocks the token after the whole hit attends to.

Regression: the local hit's sliding blocks, picked for a hit ending at the local
prefix, were all held once the tier added tokens after it. In a tight pool the request
then could not grow and was aborted ("no progress possible"), though it ran with
offload off.
"""

from __future__ import annotations

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

MODEL = ModelConfig.tiny_hybrid()  # one full-attention layer, one sliding layer (window 8)
ENGINE = EngineConfig(block_size=8, num_gpu_blocks=8)  # 7 usable blocks
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
A = list(range(33))  # at most 5 full + 2 sliding blocks: it fits
C = list(range(100, 125))  # pushes A out of the GPU cache
D = A[:8] + list(range(50, 59))  # brings A's first block back to the GPU cache


def serve(offload: OffloadConfig | None) -> list[tuple[tuple[int, ...], int, int]]:
    with LLM(MODEL, offload, ENGINE) as llm:
        results = []
        for prompt in (A, C, D, A):
            (out,) = llm.generate([prompt], ONE)
            llm.drain()
            results.append(
                (out.output_token_ids, out.num_local_hit_tokens, out.num_external_hit_tokens)
            )
        return results


def test_a_local_and_tier_hit_that_fits_is_served_as_without_offload() -> None:
    off = serve(None)
    on = serve(OffloadConfig(cpu_bytes=64 * 8 * MODEL.kv_bytes_per_token()))
    assert [tokens for tokens, _, _ in on] == [tokens for tokens, _, _ in off]
    assert on[-1][1:] == (8, 24)  # block 0 from the GPU cache, the next three from the tier


def test_the_sliding_table_holds_no_block_before_the_window_of_the_whole_hit() -> None:
    with LLM(MODEL, OffloadConfig(cpu_bytes=64 * 8 * MODEL.kv_bytes_per_token()), ENGINE) as llm:
        for prompt in (A, C, D):
            llm.generate([prompt], ONE)
            llm.drain()
        request = llm.add_request(A, ONE)
        llm.step()  # admitted with its hit; its load is in flight
        assert (request.num_computed_tokens, request.num_external_tokens) == (32, 24)
        full, sliding = request.block_tables
        assert NULL_BLOCK_ID not in full
        # Block 0 (the GPU hit) is outside the window of token 32: not held.
        assert sliding[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
        llm.drain()
