"""Greedy and seeded temperature sampling, and stop conditions."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.sampling import FinishReason, SamplingParams, finish_reason, sample


def _logits() -> torch.Tensor:
    return torch.randn(3, 50, generator=torch.Generator().manual_seed(0))


def test_greedy_takes_argmax_without_generator() -> None:
    params = [SamplingParams()] * 3
    assert params[0].make_generator() is None
    assert sample(_logits(), params, [None] * 3) == _logits().argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_per_request() -> None:
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]

    def draw() -> list[list[int]]:
        generators = [p.make_generator() for p in params]
        return [sample(_logits()[:2], params, generators) for _ in range(20)]

    first = draw()
    assert first == draw()
    assert [row[0] for row in first] != [row[1] for row in first]  # seeds differ


def test_low_temperature_concentrates_on_argmax() -> None:
    params = [SamplingParams(temperature=1e-3, seed=1)] * 3
    tokens = sample(_logits(), params, [p.make_generator() for p in params])
    assert tokens == _logits().argmax(-1).tolist()


def test_sampling_checks_arguments() -> None:
    with pytest.raises(ValueError, match="needs a generator"):
        sample(_logits()[:1], [SamplingParams(temperature=0.5)], [None])
    with pytest.raises(ValueError, match="3 logit rows, 1 params"):
        sample(_logits(), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)


def test_finish_reason() -> None:
    params = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert finish_reason(1, 1, params, eos_token_ids=(2,)) is None
    assert finish_reason(9, 1, params, eos_token_ids=(2,)) is FinishReason.STOP
    assert finish_reason(2, 1, params, eos_token_ids=(2,)) is FinishReason.STOP
    assert finish_reason(1, 3, params, eos_token_ids=(2,)) is FinishReason.LENGTH
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert finish_reason(2, 1, ignoring, eos_token_ids=(2,)) is None
