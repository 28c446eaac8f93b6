"""`generate`'s outputs carry vLLM's `RequestOutput` / `CompletionOutput` fields, with vLLM's
types.

Regression: code written for vLLM failed on the reference engine: `out.outputs[0].token_ids`
(no `outputs`), `out.num_cached_tokens`, `out.prompt_token_ids + [...]` (a tuple plus a
list: TypeError).
"""

from __future__ import annotations

import dataclasses

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.outputs import output_of
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
FREE = SamplingParams(max_tokens=6, ignore_eos=True)


def small_llm(eos: tuple[int, ...] = ()) -> LLM:
    model = dataclasses.replace(ModelConfig.tiny(), eos_token_ids=eos)
    return LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=16))


def free_tokens() -> list[int]:
    """Return the greedy tokens PROMPT runs to when nothing stops it (they differ)."""
    (out,) = small_llm().generate([PROMPT], FREE)
    tokens = list(out.output_token_ids)
    assert len(set(tokens[:3])) == 3, tokens  # the stops below are met where placed
    return tokens


def test_outputs_hold_one_vllm_completion() -> None:
    (out,) = small_llm().generate([PROMPT], FREE)
    (completion,) = out.outputs
    assert completion.token_ids == list(out.output_token_ids)
    assert type(completion.token_ids) is list
    assert type(out.prompt_token_ids) is list
    assert out.prompt_token_ids == PROMPT
    assert (completion.index, completion.text, completion.finish_reason) == (0, "", "length")
    assert (completion.cumulative_logprob, completion.logprobs, completion.stop_reason) == (
        None,
        None,
        None,
    )
    assert completion.finished()
    assert out.finished
    assert out.prompt is None
    # vLLM's multi-turn idiom: the next turn's prompt is this one, its answer and more.
    assert len(out.prompt_token_ids + completion.token_ids + [7]) == len(PROMPT) + 6 + 1


def test_stop_reason_is_the_stop_token_id_as_in_vllm() -> None:
    tokens = free_tokens()
    llm = small_llm(eos=(tokens[1],))
    (by_id,) = llm.generate([PROMPT], dataclasses.replace(FREE, stop_token_ids=[tokens[0]]))
    assert by_id.outputs[0].token_ids == tokens[:1]
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", tokens[0])
    (by_eos,) = llm.generate([PROMPT], dataclasses.replace(FREE, ignore_eos=False))
    assert by_eos.outputs[0].token_ids == tokens[:2]
    assert (by_eos.outputs[0].finish_reason, by_eos.outputs[0].stop_reason) == ("stop", None)
    # vLLM checks EOS first: an EOS that is a stop id too stops with no stop_reason ...
    both = dataclasses.replace(FREE, ignore_eos=False, stop_token_ids=[tokens[1]])
    assert llm.generate([PROMPT], both)[0].outputs[0].stop_reason is None
    # ... but with ignore_eos only the stop id stops it, and names it.
    ignored = dataclasses.replace(FREE, stop_token_ids=[tokens[1]])
    assert llm.generate([PROMPT], ignored)[0].outputs[0].stop_reason == tokens[1]


def test_num_cached_tokens_counts_the_prefix_cache_hit() -> None:
    llm = small_llm()
    (first,) = llm.generate([PROMPT], FREE)
    assert first.num_cached_tokens == 0
    (second,) = llm.generate([[*PROMPT, 7]], FREE)
    assert second.num_cached_tokens == second.num_local_hit_tokens == 8  # two full blocks


def test_num_cached_tokens_counts_a_tier_hit_too() -> None:
    engine = EngineConfig(block_size=4, num_gpu_blocks=8)
    fillers = [[100 + i] * 12 for i in range(3)]
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=1 << 22), engine=engine) as llm:
        llm.generate([PROMPT], FREE)
        llm.generate(fillers, FREE)  # the pool's 8 blocks: PROMPT's left the GPU
        llm.drain()
        (again,) = llm.generate([[*PROMPT, 7]], FREE)
    assert (again.num_local_hit_tokens, again.num_external_hit_tokens) == (0, 8)
    assert again.num_cached_tokens == 8


def test_the_output_times_are_the_requests_ttft_and_tpot() -> None:
    """Mutant (s32 mutation run): `output_of` swapping ttft_s and tpot_s passed every
    test (the demo's TTFT columns would have shown time per output token)."""
    with small_llm() as llm:
        request = llm.add_request(PROMPT, FREE)
        while not llm.step():
            pass
        out = output_of(request, llm.model_config)
    assert request.ttft is not None
    assert request.tpot is not None
    assert request.ttft != request.tpot
    assert (out.ttft_s, out.tpot_s) == (request.ttft, request.tpot)
