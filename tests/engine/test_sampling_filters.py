"""vLLM's `top_k`, `top_p` and `min_p` filter the temperature-scaled distribution (in
vLLM's order: min_p, top_k, top_p), deterministically given the request's seed; values
out of vLLM's ranges are refused by name and value. A temperature in (0, 0.01) is raised
to 0.01, as vLLM does.

Regression: `SamplingParams(top_p=0.9)` (or top_k, min_p) raised "unexpected keyword
argument", so code written for vLLM failed on the reference engine; a temperature of
0.001 was kept where vLLM samples at 0.01.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams, sample

VOCAB = 50
NUM_DRAWS = 400


def _logits(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 2


def _draws(row: torch.Tensor, params: SamplingParams) -> list[int]:
    """Return one token per seed 0 .. NUM_DRAWS - 1 sampled from `row`."""
    tokens = []
    for seed in range(NUM_DRAWS):
        generator = torch.Generator().manual_seed(seed)
        tokens += sample(row[None], [params], [generator])
    return tokens


def _top_p_set(probs: torch.Tensor, top_p: float) -> set[int]:
    """Return the fewest most likely tokens whose probabilities sum to at least top_p."""
    order = probs.double().argsort(descending=True).tolist()
    kept, total = [], 0.0
    for token in order:
        kept.append(token)
        total += float(probs[token])
        if total >= top_p:
            break
    return set(kept)


def _allowed(row: torch.Tensor, temperature: float, fields: dict[str, Any]) -> set[int]:
    """Return the tokens vLLM's sampler may draw from `row`, computed in float64."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    allowed = set(range(VOCAB))
    if fields.get("min_p", 0.0) > 0:
        allowed = {t for t in allowed if probs[t] >= fields["min_p"] * probs.max()}
    if fields.get("top_k", 0) > 0:
        allowed &= set(probs.argsort(descending=True)[: fields["top_k"]].tolist())
    if fields.get("top_p", 1.0) < 1:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[list(allowed)] = True
        kept = torch.where(mask, probs, 0.0)
        allowed = _top_p_set(kept / kept.sum(), fields["top_p"])
    return allowed


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize(
    "fields", [{"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_the_tightest_filters_sample_the_argmax(temperature: float, fields: dict[str, Any]) -> None:
    params = SamplingParams(temperature=temperature, **fields)
    for row in _logits():
        assert set(_draws(row, params)) == {int(row.argmax())}


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 4},
        {"top_p": 0.5},
        {"min_p": 0.1},
        {"top_k": 8, "top_p": 0.7},
        {"min_p": 0.05, "top_k": 6, "top_p": 0.8},
    ],
    ids=["top_k", "top_p", "min_p", "top_k+top_p", "all"],
)
def test_filtered_out_tokens_are_never_sampled_over_many_seeds(fields: dict[str, Any]) -> None:
    temperature = 1.5
    params = SamplingParams(temperature=temperature, **fields)
    unfiltered = SamplingParams(temperature=temperature)
    for row in _logits():
        allowed = _allowed(row, temperature, fields)
        drawn = set(_draws(row, params))
        assert drawn <= allowed, (fields, drawn - allowed)
        assert len(drawn) > 1  # it samples, not only the argmax
        assert not set(_draws(row, unfiltered)) <= allowed  # the filter ruled tokens out


def test_the_filters_are_off_at_their_defaults_and_top_k_minus_one() -> None:
    row = _logits()[0]
    plain = _draws(row, SamplingParams(temperature=1.0))
    off = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    assert _draws(row, off) == plain
    assert _draws(row, SamplingParams(temperature=1.0, top_k=VOCAB)) == plain


def test_filtered_sampling_is_deterministic_given_the_seed() -> None:
    params = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.01)
    row = _logits()[1]
    assert _draws(row, params) == _draws(row, params)


def tokens(params: SamplingParams) -> list[tuple[int, ...]]:
    llm = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=32))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    return [out.output_token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "fields", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_the_engine_samples_greedily_under_the_tightest_filters(fields: dict[str, Any]) -> None:
    greedy = tokens(SamplingParams(max_tokens=8, ignore_eos=True))
    filtered = SamplingParams(max_tokens=8, ignore_eos=True, temperature=2.0, seed=3, **fields)
    assert tokens(filtered) == greedy
    # Without the filter, the same seed strays from the greedy tokens.
    free = SamplingParams(max_tokens=8, ignore_eos=True, temperature=2.0, seed=3)
    assert tokens(free) != greedy


def test_a_greedy_request_stores_the_filters_as_off_as_vllm() -> None:
    params = SamplingParams(top_k=3, top_p=0.5, min_p=0.2)
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
    sampled = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.2)
    assert (sampled.top_k, sampled.top_p, sampled.min_p) == (3, 0.5, 0.2)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": float("nan")}, ValueError, r"top_p must be in \(0, 1\], got nan"),
        ({"top_p": "0.9"}, TypeError, r"top_p must be a float in \(0, 1\], got '0.9'"),
        ({"top_p": None}, TypeError, r"top_p must be a float in \(0, 1\], got None"),
        ({"top_k": -2}, ValueError, r"top_k must be 0 or -1 \(off\), or at least 1, got -2"),
        ({"top_k": 1.0}, TypeError, r"top_k must be an int \(0 or -1: off\), got 1.0"),
        ({"top_k": True}, TypeError, r"top_k must be an int \(0 or -1: off\), got True"),
        ({"min_p": -0.1}, ValueError, r"min_p must be in \[0, 1\], got -0.1"),
        ({"min_p": 1.01}, ValueError, r"min_p must be in \[0, 1\], got 1.01"),
        ({"min_p": "0"}, TypeError, r"min_p must be a float in \[0, 1\], got '0'"),
    ],
)
def test_out_of_range_filters_are_refused_by_name_and_value(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(temperature=1.0, **fields)
    with pytest.raises(error, match=message):  # refused when greedy too, as in vLLM
        SamplingParams(**fields)


@pytest.mark.parametrize("temperature", [1e-3, 1e-6, 1e-40, 5e-324])
def test_a_temperature_below_a_hundredth_is_raised_to_it_as_in_vllm(
    temperature: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.sampling"):
        params = SamplingParams(temperature=temperature, seed=1)
    assert params.temperature == 0.01
    assert not params.is_greedy
    assert f"temperature {temperature} is below 0.01: raised to 0.01" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.sampling"):
        assert SamplingParams(temperature=0.01).temperature == 0.01
    assert caplog.text == ""  # 0.01 itself is not below 0.01: no warning
    assert SamplingParams(temperature=0).is_greedy
    row = torch.tensor([1.0, 1.01, 0.0])  # at 0.01: token 1 about 73%, token 0 about 27%
    assert set(_draws(row, params)) == {0, 1}


def test_top_p_keeps_the_tokens_summing_exactly_to_it() -> None:
    """vLLM drops the least likely tokens while they sum to at most 1 - top_p: four equally
    likely tokens at top_p=0.75 keep three (they sum to exactly 0.75), never all four.
    Mutation: dropping only while the sum was below 1 - top_p kept all four."""
    row = torch.zeros(4)
    assert len(set(_draws(row, SamplingParams(temperature=1.0, top_p=0.75)))) == 3
