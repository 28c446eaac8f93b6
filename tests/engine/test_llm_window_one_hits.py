"""Local hit counts of a model whose only layers slide over a window of one token.

Regression: such a layer attends to no earlier token, so its group needs no cached
block before a hit, and the longest hit took every prompt, seen or not: a fresh prompt
was reported as a local (GPU prefix cache) hit of all its whole blocks, and its stats
overstated the hits. A hit must be a prefix served before (SPEC §5): its last block is
cached.
"""

from __future__ import annotations

import dataclasses

from kvtier.core.keys import make_key
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

MODEL = dataclasses.replace(
    ModelConfig.tiny_hybrid(),
    layer_kinds=(AttentionKind.SLIDING, AttentionKind.SLIDING),
    sliding_window=1,
)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=32)
TWO = SamplingParams(max_tokens=2, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two whole blocks before its last token


def test_a_prompt_never_seen_is_no_local_hit() -> None:
    """A fresh prompt hits nothing: every token is computed, and the stats count no hit."""
    with LLM(MODEL, engine=ENGINE) as llm:
        (out,) = llm.generate([PROMPT], TWO)
        assert (out.num_local_hit_tokens, out.num_cached_tokens) == (0, 0)
        assert llm.stats.num_local_hit_tokens == 0
        assert llm.stats.num_computed_tokens == len(PROMPT) + 1  # every prompt token, one decode


def test_a_prompt_served_before_hits_its_whole_blocks_with_the_same_tokens() -> None:
    """The same prompt again hits its 2 whole blocks and samples the same tokens; a prompt
    ending in the same token after another prefix hits nothing."""
    with LLM(MODEL, engine=ENGINE) as llm:
        (first,) = llm.generate([PROMPT], TWO)
        (again,) = llm.generate([PROMPT], TWO)
        other = [20, 21, 22, 23, 24, 25, 26, 27, 9]  # same last token, other prefix
        (fresh,) = llm.generate([other], TWO)
    assert again.num_local_hit_tokens == 8
    assert again.output_token_ids == first.output_token_ids
    assert fresh.num_local_hit_tokens == 0


def run(llm: LLM, prompt: list[int]) -> Request:
    """Run `prompt` to its end, and its blocks' stores too: the next request's lookup
    finds them in the tier (not only when the store thread happened to finish first)."""
    request = llm.add_request(prompt, TWO)
    while request.status is not RequestStatus.FINISHED:
        llm.step()
    llm.drain()
    return request


def test_with_a_cpu_tier_the_tokens_are_those_without_it_and_nothing_is_loaded() -> None:
    """(SPEC §9 scenario 31) The tokens are those without a tier. The tier holds the block
    ending a hit (asserted), but a hit of this model loads no block: the tier offers none
    (it divided by the 0 blocks to load), the tokens are recomputed."""
    offload = OffloadConfig(cpu_bytes=64 * 4 * MODEL.kv_bytes_per_token())
    other = list(range(60, 100))  # evicts PROMPT from the GPU cache
    outputs = {}
    for name, tier in (("off", None), ("cpu", offload)):
        with LLM(MODEL, tier, EngineConfig(block_size=4, num_gpu_blocks=12)) as llm:
            first = run(llm, PROMPT)
            if llm.offload is not None:
                end = make_key(first.block_hashes[1], 0)  # the block ending a hit of 8
                assert llm.offload.scheduler.index.cached_block(end) is not None
            outputs[name] = [first] + [run(llm, p) for p in (other, PROMPT, other)]
            assert llm.stats.num_external_hit_tokens == 0
    assert [o.output_token_ids for o in outputs["cpu"]] == [
        o.output_token_ids for o in outputs["off"]
    ]
