"""`SamplingParams.logprobs` returns vLLM's sample logprobs: per output token a dict of
`Logprob`s (the sampled token first, with its rank, then the `logprobs` most likely), raw
(before temperature), and their sum as `cumulative_logprob`.

Regression: `SamplingParams(logprobs=...)` was refused ("unexpected keyword argument"),
and `CompletionOutput.logprobs` / `cumulative_logprob` did not exist, where code written
for vLLM reads them (e.g. to score outputs).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.engine.forward import keep_sampled
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampling import SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def run(
    params: SamplingParams, keep_logits: bool = True, max_logprobs: int = 20
) -> list[RequestOutput]:
    engine = EngineConfig(
        block_size=4, num_gpu_blocks=16, keep_logits=keep_logits, max_logprobs=max_logprobs
    )
    return LLM(None, engine=engine).generate(PROMPTS, params)


@pytest.mark.parametrize("temperature", [0.0, 1.5], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_top", [0, 1, 3])
def test_logprobs_are_the_raw_log_softmax_of_the_sampled_logits(
    num_top: int, temperature: float
) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=temperature, seed=7)
    with_logprobs = SamplingParams(
        max_tokens=5, ignore_eos=True, temperature=temperature, seed=7, logprobs=num_top
    )
    outputs = run(with_logprobs)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in run(params)]
    for output in outputs:
        (completion,) = output.outputs
        assert output.logits is not None
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for token, row, position in zip(
            completion.token_ids, output.logits, completion.logprobs, strict=True
        ):
            expected = torch.log_softmax(row, dim=-1)
            order = expected.argsort(descending=True).tolist()
            assert next(iter(position)) == token  # the sampled token first, as vLLM
            assert position[token].rank == order.index(token) + 1
            assert set(position) == {token, *order[:num_top]}
            for top_token, logprob in position.items():
                assert logprob.logprob == pytest.approx(float(expected[top_token]), abs=1e-5)
                assert logprob.decoded_token is None
                if top_token != token:
                    assert logprob.rank == order.index(top_token) + 1
            total += position[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)
        assert completion.cumulative_logprob < 0


def test_logprobs_minus_one_gives_the_whole_vocab_and_none_gives_none() -> None:
    everything_params = SamplingParams(max_tokens=2, logprobs=-1)
    (everything, _) = run(everything_params, keep_logits=False, max_logprobs=-1)
    assert everything.outputs[0].logprobs is not None
    for position in everything.outputs[0].logprobs:
        assert len(position) == 128
        assert math.fsum(math.exp(p.logprob) for p in position.values()) == pytest.approx(1.0)
    (nothing, _) = run(SamplingParams(max_tokens=2), keep_logits=False)
    assert (nothing.outputs[0].logprobs, nothing.outputs[0].cumulative_logprob) == (None, None)


def test_more_logprobs_than_the_vocab_are_refused_by_value() -> None:
    llm = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=16))
    with pytest.raises(ValueError, match=r"prompt 1: logprobs=129, more than the vocab's 128"):
        llm.generate(PROMPTS, [SamplingParams(), SamplingParams(logprobs=129)])
    assert llm.stats.num_steps == 0
    # As many as the vocab holds is taken (mutation: '>=' refused logprobs=128 as more).
    engine = EngineConfig(block_size=4, num_gpu_blocks=16, max_logprobs=-1)
    (out,) = LLM(None, engine=engine).generate(
        PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=128)
    )
    assert out.outputs[0].logprobs is not None
    assert [len(position) for position in out.outputs[0].logprobs] == [128]


@pytest.mark.parametrize(
    ("max_logprobs", "logprobs", "message"),
    [
        (20, 21, r"prompt 1: logprobs=21 is more than max_logprobs=20: ask for at most 20"),
        (20, -1, r"prompt 1: logprobs=-1 \(the whole vocab, 128\) is more than max_logprobs=20"),
        (0, 1, r"prompt 1: logprobs=1 is more than max_logprobs=0"),
    ],
)
def test_more_logprobs_than_max_logprobs_are_refused_by_value(
    max_logprobs: int, logprobs: int, message: str
) -> None:
    """Regression: any count up to the vocab was served where vLLM (`max_logprobs`, 20 by
    default) refuses more, so code tested here failed when moved to vLLM."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=16, max_logprobs=max_logprobs)
    llm = LLM(None, engine=engine)
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS, [SamplingParams(), SamplingParams(logprobs=logprobs)])
    assert llm.stats.num_steps == 0
    # At the cap it runs (0 logprobs: the sampled token's alone).
    (_, at_cap) = llm.generate(PROMPTS, [SamplingParams(), SamplingParams(logprobs=max_logprobs)])
    assert at_cap.outputs[0].logprobs is not None


def test_a_preempted_request_keeps_one_logprobs_entry_per_token() -> None:
    prompts = [[i, 1, 4, 1, 5, 9, 2, 6] for i in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    tight = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=7))
    outputs = tight.generate(prompts, params)
    assert tight.stats.num_preemptions > 0
    roomy = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=64)).generate(
        prompts, params
    )
    for output, expected in zip(outputs, roomy, strict=True):
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        logprobs, expected_logprobs = output.outputs[0].logprobs, expected.outputs[0].logprobs
        assert logprobs is not None
        assert expected_logprobs is not None
        assert [list(p) for p in logprobs] == [list(p) for p in expected_logprobs]
        assert output.outputs[0].cumulative_logprob == pytest.approx(
            expected.outputs[0].cumulative_logprob, abs=1e-4
        )


def test_a_tied_sampled_token_ranks_after_its_ties_as_in_vllm() -> None:
    """vLLM ranks the sampled token by the tokens at least as likely, itself included
    (`batched_count_greater_than`: x >= value)."""
    request = SimpleNamespace(
        params=SamplingParams(logprobs=0),
        kept_logits=[],
        sample_logprobs=[],
        cumulative_logprob=0.0,
    )
    step: Any = SimpleNamespace(work=[SimpleNamespace(request=request)])
    keep_sampled(step, [2], torch.tensor([[1.0, 3.0, 3.0, 0.0]]), keep_logits=False)
    ((only,),) = [list(position.items()) for position in request.sample_logprobs]
    assert (only[0], only[1].rank) == (2, 2)
    expected = math.log(math.e**3 / (2 * math.e**3 + math.e + 1))
    assert only[1].logprob == pytest.approx(expected)
    assert request.cumulative_logprob == pytest.approx(expected)


def test_a_tied_sampled_token_among_the_top_ones_takes_its_top_rank_as_in_vllm() -> None:
    """vLLM builds a position's dict from the sampled token (rank: the tokens at least as
    likely) then the `logprobs` most likely (ranks 1, 2, ...), so a sampled token among
    them ends with its rank there. Tokens 0 and 1 tie: whichever is sampled, vLLM 0.33
    (`Sampler.gather_logprobs` + `append_logprobs_for_next_position`) ranks them 1 and 2.

    Regression: the sampled token kept its count rank 2 where topk put it first, so
    both tied tokens were ranked 2 (found by a differential run against vLLM's sampler).
    """
    logits = torch.tensor([[3.0, 3.0, 0.0, 1.0]])
    expected = math.log(math.e**3 / (2 * math.e**3 + math.e + 1))
    for token in (0, 1):
        request = SimpleNamespace(
            params=SamplingParams(logprobs=2),
            kept_logits=[],
            sample_logprobs=[],
            cumulative_logprob=0.0,
        )
        step: Any = SimpleNamespace(work=[SimpleNamespace(request=request)])
        keep_sampled(step, [token], logits, keep_logits=False)
        (position,) = request.sample_logprobs
        assert next(iter(position)) == token
        assert set(position) == {0, 1}
        assert sorted(logprob.rank for logprob in position.values()) == [1, 2]
        assert [logprob.logprob for logprob in position.values()] == pytest.approx(
            [expected, expected]
        )
        assert request.cumulative_logprob == pytest.approx(expected)
