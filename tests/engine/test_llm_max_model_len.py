"""The model's `max_position` as vLLM's `max_model_len` (vLLM 0.33's `check_stop` and
`InputProcessor`): an output that would pass it is cut there ("length"), and
`max_tokens=None` runs up to it; a prompt must leave room for one output token.

Regression: the engine refused a prompt plus `max_tokens` beyond `max_position` (code
ported from vLLM failed where vLLM runs), refused `max_tokens=None` with a TypeError,
and ran a prompt of exactly `max_position` tokens that vLLM refuses.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import FinishReason, SamplingParams, finish_reason
from kvtier.offload.config import OffloadConfig, StoreMode

MAX_LEN = 16
MODEL = dataclasses.replace(ModelConfig.tiny(), max_position=MAX_LEN)
ROOMY = EngineConfig(block_size=4, num_gpu_blocks=64)
PROMPT = [5, 9, 1, 33, 7, 120, 64, 3, 8, 17]  # 10 tokens: room for 6 more


def outputs(
    params: SamplingParams, prompt: list[int] = PROMPT, engine: EngineConfig = ROOMY
) -> tuple[tuple[int, ...], str]:
    """Return the output tokens and finish reason of `prompt` on a fresh engine."""
    (output,) = LLM(MODEL, engine=engine).generate([prompt], params)
    assert output.outputs[0].finish_reason == output.finish_reason
    return output.output_token_ids, output.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_output_past_max_position_stops_there_with_length(temperature: float) -> None:
    params = SamplingParams(max_tokens=50, temperature=temperature, seed=3, ignore_eos=True)
    capped, reason = outputs(params)
    exact = outputs(dataclasses.replace(params, max_tokens=MAX_LEN - len(PROMPT)))
    assert (len(capped), reason) == (MAX_LEN - len(PROMPT), "length")
    assert (capped, reason) == exact
    # The same through add_request / step.
    llm = LLM(MODEL, engine=ROOMY)
    request = llm.add_request(PROMPT, params)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert (tuple(request.output_token_ids), request.finish_reason) == (
        capped,
        FinishReason.LENGTH,
    )
    assert request.params.max_tokens == 50  # as vLLM's: the cap is the model's, not a change


def test_max_tokens_none_runs_up_to_max_position() -> None:
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    assert params.max_tokens is None
    tokens, reason = outputs(params)
    assert (tokens, reason) == outputs(SamplingParams(max_tokens=6, ignore_eos=True))
    # As vLLM's InputProcessor: the request's params hold max_position - prompt length.
    llm = LLM(MODEL, engine=ROOMY)
    assert llm.add_request(PROMPT, params).params.max_tokens == MAX_LEN - len(PROMPT)
    assert llm.add_request([1, 2], params).params.max_tokens == MAX_LEN - 2
    assert params.max_tokens is None  # the caller's params are left as given


def test_a_prompt_one_short_of_max_position_gets_one_token() -> None:
    tokens, reason = outputs(SamplingParams(max_tokens=None), list(range(MAX_LEN - 1)))
    assert (len(tokens), reason) == (1, "length")


@pytest.mark.parametrize(
    ("num_prompt", "message"),
    [
        (MAX_LEN, "prompt of 16 tokens leaves no room for an output within the model's"),
        (MAX_LEN + 1, "prompt of 17 tokens is longer than the model's"),
    ],
)
@pytest.mark.parametrize("max_tokens", [1, None])
def test_a_prompt_of_max_position_tokens_or_more_is_refused(
    num_prompt: int, message: str, max_tokens: int | None
) -> None:
    llm = LLM(MODEL, engine=ROOMY)
    with pytest.raises(ValueError, match=f"^prompt 1: {message} max_position=16 .*at most 15"):
        llm.generate([[1, 2], list(range(num_prompt))], SamplingParams(max_tokens=max_tokens))
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()


def test_the_pool_check_counts_the_capped_length() -> None:
    """16 tokens, 15 positions computed: 4 blocks of 4 at the last step, whatever
    max_tokens asks for. A pool of 4 usable blocks runs it; one of 3 refuses it."""
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    tight = EngineConfig(block_size=4, num_gpu_blocks=5)
    assert outputs(params, engine=tight) == outputs(params)
    with pytest.raises(
        ValueError,
        match=r"^prompt 0: prompt of 10 tokens \+ max_tokens=1000, capped at max_position=16 "
        r"needs at least 4 KV blocks at one step, more than the GPU pool's 3 usable blocks",
    ):
        LLM(MODEL, engine=EngineConfig(block_size=4, num_gpu_blocks=4)).generate([PROMPT], params)


def test_a_stop_token_at_max_position_is_a_stop() -> None:
    """As vLLM's check_stop: a stop or EOS token is checked before the length cap."""
    params = SamplingParams(max_tokens=None, stop_token_ids=(7,))
    at_cap = {"num_tokens": MAX_LEN, "max_model_len": MAX_LEN}
    assert finish_reason(7, 6, params, (), **at_cap) is FinishReason.STOP
    assert finish_reason(2, 6, params, (2,), **at_cap) is FinishReason.STOP
    assert finish_reason(3, 6, params, (2,), **at_cap) is FinishReason.LENGTH
    assert finish_reason(3, 5, params, (2,), num_tokens=15, max_model_len=MAX_LEN) is None


OffloadRun = tuple[tuple[int, ...], str, tuple[int, ...], tuple[int, int], int]


def offload_run(model: ModelConfig, max_tokens: int, mode: StoreMode) -> OffloadRun:
    """Run a request, a 15-token one that evicts its blocks from a 5-block GPU pool,
    then its prompt and first 4 output tokens (+1): return their outputs and the last
    one's hit tokens (in the GPU cache and from the tier: how they split depends on when
    the stores finish), and the bytes the tier stored."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=6)
    config = OffloadConfig(cpu_bytes=4 << 20, store_mode=mode)
    with LLM(model, kv_offload=config, engine=engine) as llm:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        (first,) = llm.generate([PROMPT], params)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([list(range(100, 115))], one)
        llm.drain()
        follow = PROMPT + list(first.output_token_ids[:4]) + [44]  # 15 tokens
        (second,) = llm.generate([follow], one)
        llm.drain()
        assert llm.offload is not None
        stored = llm.offload.totals.num_bytes_stored
    hits = (second.num_local_hit_tokens, second.num_external_hit_tokens)
    return first.output_token_ids, first.finish_reason, second.output_token_ids, hits, stored


@pytest.mark.parametrize("mode", [StoreMode.EAGER, StoreMode.LAZY], ids=str)
def test_a_capped_request_is_stored_and_served_as_one_asking_that_many(mode: StoreMode) -> None:
    """The capped run (max_position 16, max_tokens=40) gives what a run on a longer
    model asking for exactly its 6 tokens does; eagerly, both store every full block
    (3 per request) and serve the third request's 3 hit blocks, 2 or more from the tier."""
    capped = offload_run(MODEL, 40, mode)
    longer = offload_run(dataclasses.replace(MODEL, max_position=64), 6, mode)
    assert capped[:3] == longer[:3]
    assert capped[:2] == outputs(SamplingParams(max_tokens=None, ignore_eos=True))
    if mode is StoreMode.EAGER:
        for local, external in (capped[3], longer[3]):
            assert local + external == 12
            assert external >= 8
        assert capped[4] == longer[4] == 6 * 2048
