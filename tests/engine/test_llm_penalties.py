"""The engine applies vLLM's penalties and `min_tokens` on the tiny random model: each
token is the one its raw logits (kept with `keep_logits`) give once penalized as vLLM
does, computed here in plain Python; a request samples the same batched or alone.

Regression: `SamplingParams(repetition_penalty=...)`, `presence_penalty`,
`frequency_penalty` and `min_tokens` raised "unexpected keyword argument": code written
for vLLM failed on the engine, and a model whose first greedy token is its EOS gave an
empty-looking one-token answer however many tokens were asked for at least.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import FinishReason, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 1, 64], [5, 5, 5, 5]]  # 2nd: greedily 64, 64, ...
ENGINE = EngineConfig(num_gpu_blocks=64, keep_logits=True)


def penalized(row: Sequence[float], request: Request, at: int, eos: Sequence[int]) -> list[float]:
    """Return vLLM's logits for `request`'s output token `at` from its raw `row`."""
    params, prompt = request.params, request.prompt_token_ids
    output = request.output_token_ids[:at]
    out = list(row)
    if len(output) < params.min_tokens:
        for token in [*eos, *params.stop_token_ids]:
            out[token] = -math.inf
    for token in range(len(out)):
        if token in prompt or token in output:
            factor = params.repetition_penalty
            out[token] = out[token] / factor if out[token] > 0 else out[token] * factor
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + (params.presence_penalty if count else 0)
    return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Request]:
    requests = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    for _ in range(1000):
        if all(r.finish_reason is not None for r in requests):
            return requests
        llm.step()
    raise AssertionError("requests did not finish in 1000 steps")


def assert_greedy_follows_the_reference(request: Request, eos: Sequence[int]) -> None:
    assert len(request.kept_logits) == len(request.output_token_ids)
    for at, (row, token) in enumerate(
        zip(request.kept_logits, request.output_token_ids, strict=True)
    ):
        logits = penalized(row.tolist(), request, at, eos)
        best = max(logits)
        assert token == logits.index(best), (request.request_id, at)


def test_a_large_repetition_penalty_changes_greedy_output_as_vllm() -> None:
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    heavy = dataclasses.replace(plain, repetition_penalty=20.0)
    mixed = dataclasses.replace(plain, presence_penalty=1.5, frequency_penalty=0.75)
    with LLM(None, engine=ENGINE) as llm:
        base = run(llm, PROMPTS, [plain] * 3)
        penalized_runs = run(llm, PROMPTS, [heavy] * 3)
        mixed_runs = run(llm, PROMPTS, [mixed] * 3)
        again = run(llm, PROMPTS, [heavy] * 3)
    assert [r.output_token_ids for r in penalized_runs] == [r.output_token_ids for r in again]
    for request in (*penalized_runs, *mixed_runs):
        assert_greedy_follows_the_reference(request, ())
    # The tiny model repeats itself greedily; a penalty of 20 leaves no seen token ahead.
    assert any(len(set(r.output_token_ids)) < 12 for r in base)
    assert [r.output_token_ids for r in penalized_runs] != [r.output_token_ids for r in base]
    for request in penalized_runs:
        assert len(set(request.output_token_ids)) == 12
        assert not set(request.output_token_ids) & set(request.prompt_token_ids)
    assert [r.output_token_ids for r in mixed_runs] != [r.output_token_ids for r in base]
    # The logits kept (and logprobs) stay raw, as vLLM's default logprobs_mode.
    for request, other in zip(base, penalized_runs, strict=True):
        assert request.kept_logits[0].equal(other.kept_logits[0])


def _eos_first_model(prompt: list[int]) -> tuple[ModelConfig, int]:
    """Return the tiny model with its greedy first token for `prompt` as its EOS."""
    with LLM(None, engine=ENGINE) as llm:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1))
    first = out.output_token_ids[0]
    return dataclasses.replace(ModelConfig.tiny(), eos_token_ids=(first,)), first


def test_min_tokens_holds_off_an_eos_greedy_would_emit_first() -> None:
    prompt = PROMPTS[0]
    model, eos = _eos_first_model(prompt)
    with LLM(model, engine=ENGINE) as llm:
        (early,) = run(llm, [prompt], [SamplingParams(max_tokens=10)])
        (held,) = run(llm, [prompt], [SamplingParams(max_tokens=10, min_tokens=6)])
        stop = SamplingParams(max_tokens=10, min_tokens=6, stop_token_ids=[eos], ignore_eos=True)
        (held_stop,) = run(llm, [prompt], [stop])
        # As vLLM, min_tokens masks the EOS ids even with ignore_eos.
        ignoring = SamplingParams(max_tokens=3, min_tokens=2, ignore_eos=True)
        (ignored,) = run(llm, [prompt], [ignoring])
    assert early.output_token_ids == [eos]
    assert early.finish_reason is FinishReason.STOP
    for request in (held, held_stop):
        assert len(request.output_token_ids) >= 6
        assert eos not in request.output_token_ids[:6]
        assert_greedy_follows_the_reference(request, (eos,))
    assert ignored.output_token_ids[0] != eos
    assert_greedy_follows_the_reference(ignored, (eos,))


def test_a_batch_of_mixed_penalties_gives_each_request_its_tokens_alone() -> None:
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_tokens=10, temperature=0.8, seed=4, frequency_penalty=1.0),
        SamplingParams(max_tokens=10, ignore_eos=True),  # no penalties beside them
        SamplingParams(max_tokens=10, temperature=1.0, seed=9, presence_penalty=-1.0, top_k=5),
        SamplingParams(max_tokens=10, min_tokens=4, repetition_penalty=0.5),
    ]
    prompts = [*PROMPTS, [2, 7, 1, 8, 2, 8], [4, 2, 4, 2, 4]]
    with LLM(None, engine=ENGINE) as llm:
        batched = [r.output_token_ids for r in run(llm, prompts, params)]
    alone = []
    for prompt, p in zip(prompts, params, strict=True):
        with LLM(None, engine=ENGINE) as llm:
            alone += [r.output_token_ids for r in run(llm, [prompt], [p])]
    assert batched == alone
