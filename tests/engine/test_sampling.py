"""Greedy and seeded temperature sampling, and stop conditions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.engine.sampling import FinishReason, SamplingParams, finish_reason, sample


def _logits() -> torch.Tensor:
    return torch.randn(3, 50, generator=torch.Generator().manual_seed(0))


def _source() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_only_unseeded_temperature_requests_draw_from_the_seed_source() -> None:
    """Regression: an unseeded request drew its seed from torch's global RNG."""
    with torch.random.fork_rng(devices=[]):  # the seeds stay in this test
        torch.manual_seed(1)
        first = SamplingParams(temperature=1.0).make_generator(_source())
        torch.manual_seed(2)
        second = SamplingParams(temperature=1.0).make_generator(_source())
    assert first is not None
    assert second is not None
    assert first.initial_seed() == second.initial_seed()
    source = _source()
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        params.make_generator(source)
    assert torch.equal(source.get_state(), _source().get_state())  # no draw
    state = torch.get_rng_state()
    SamplingParams(temperature=1.0).make_generator(source)
    assert not torch.equal(source.get_state(), _source().get_state())
    assert torch.equal(torch.get_rng_state(), state)


def test_greedy_takes_argmax_without_generator() -> None:
    params = [SamplingParams()] * 3
    assert params[0].make_generator(_source()) is None
    assert sample(_logits(), params, [None] * 3) == _logits().argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_per_request() -> None:
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]

    def draw() -> list[list[int]]:
        generators = [p.make_generator(_source()) for p in params]
        return [sample(_logits()[:2], params, generators) for _ in range(20)]

    first = draw()
    assert first == draw()
    assert [row[0] for row in first] != [row[1] for row in first]  # seeds differ


def test_low_temperature_concentrates_on_argmax() -> None:
    params = [SamplingParams(temperature=1e-3, seed=1)] * 3
    tokens = sample(_logits(), params, [p.make_generator(_source()) for p in params])
    assert tokens == _logits().argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324])
def test_a_tiny_temperature_takes_the_argmax(temperature: float) -> None:
    # Regression: logits / 1e-40 overflowed float32 to inf, the softmax gave NaN and
    # torch.multinomial raised, aborting every request of the step. (Such temperatures
    # are now raised to vLLM's 0.01: test_sampling_filters; these logits' gaps keep 0.01
    # on the argmax.)
    params = [SamplingParams(temperature=temperature, seed=1)] * 3
    tokens = sample(_logits(), params, [p.make_generator(_source()) for p in params])
    assert tokens == _logits().argmax(-1).tolist()


def test_sampling_checks_arguments() -> None:
    with pytest.raises(ValueError, match="needs a generator"):
        sample(_logits()[:1], [SamplingParams(temperature=0.5)], [None])
    with pytest.raises(ValueError, match="3 logit rows, 1 params"):
        sample(_logits(), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\], got -1.0"):
        SamplingParams(temperature=-1.0)


def test_finish_reason() -> None:
    params = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert finish_reason(1, 1, params, eos_token_ids=(2,)) is None
    assert finish_reason(9, 1, params, eos_token_ids=(2,)) is FinishReason.STOP
    assert finish_reason(2, 1, params, eos_token_ids=(2,)) is FinishReason.STOP
    assert finish_reason(1, 3, params, eos_token_ids=(2,)) is FinishReason.LENGTH
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert finish_reason(2, 1, ignoring, eos_token_ids=(2,)) is None


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"temperature": float("nan")}, ValueError, r"temperature must be in \[0, 2\], got nan"),
        ({"temperature": float("inf")}, ValueError, r"temperature must be in \[0, 2\], got inf"),
        ({"temperature": "0.5"}, TypeError, r"temperature must be a float in \[0, 2\], got '0.5'"),
        ({"temperature": None}, TypeError, r"temperature must be a float in \[0, 2\], got None"),
        ({"temperature": True}, TypeError, r"temperature must be a float in \[0, 2\], got True"),
        ({"max_tokens": True}, TypeError, "max_tokens must be a positive int, got True"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be a positive int, got 2.0"),
        ({"seed": -2}, ValueError, r"seed must be in \[0, 2\*\*63\) or -1 \(no seed\), got -2"),
        ({"seed": 2**70}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": 2**63}, ValueError, r"seed must be in \[0, 2\*\*63\).*got 9223372036854775808"),
        ({"seed": "x"}, TypeError, "seed must be an int or None, got 'x'"),
        ({"seed": 1.0}, TypeError, "seed must be an int or None, got 1.0"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a sequence of token ids, got 5"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids must be a sequence"),
        ({"stop_token_ids": (1, 2.5)}, TypeError, "stop_token_ids must hold int token ids"),
        ({"stop_token_ids": (True,)}, TypeError, "stop_token_ids must hold int token ids"),
        ({"stop_token_ids": (-1,)}, ValueError, r"stop_token_ids must be >= 0, got \(-1,\)"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool, got 1"),
    ],
)
def test_invalid_sampling_params_name_the_field(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    """Regression: these were accepted and failed later inside a step (or never)."""
    with pytest.raises(error, match=message):
        SamplingParams(**changes)  # type: ignore[arg-type]


def test_stop_token_ids_may_be_any_int_sequence() -> None:
    params = SamplingParams(stop_token_ids=[5, np.int64(7)])  # type: ignore[arg-type]
    assert params.stop_token_ids == (5, 7)
    assert all(type(t) is int for t in params.stop_token_ids)
    assert finish_reason(7, 1, params, eos_token_ids=()) is FinishReason.STOP
    assert SamplingParams(temperature=1, seed=2**63 - 1).make_generator(_source()) is not None


@pytest.mark.parametrize(
    ("changes", "stored"),
    [
        ({"max_tokens": np.int64(4)}, {"max_tokens": 4}),
        ({"seed": np.uint32(7), "temperature": 1.0}, {"seed": 7, "temperature": 1.0}),
        ({"temperature": np.float32(0.5)}, {"temperature": 0.5}),
        ({"temperature": np.float64(0.25)}, {"temperature": 0.25}),
        ({"temperature": np.int64(2)}, {"temperature": 2.0}),
        ({"temperature": 1.0, "top_p": np.float32(0.5)}, {"top_p": 0.5}),
        (
            {"temperature": 1.0, "min_p": np.float64(0.25), "top_p": 1},
            {"min_p": 0.25, "top_p": 1.0},
        ),
        ({"temperature": 1.0, "top_k": np.int64(5)}, {"top_k": 5}),
    ],
)
def test_numpy_numbers_are_taken_as_python_ones(
    changes: dict[str, object], stored: dict[str, object]
) -> None:
    """Regression: np.int64(4) was refused as 'max_tokens must be a positive int, got
    np.int64(4)' and np.float32(0.5) as 'temperature must be a float >= 0' (np.float64,
    a float subclass, passed and was kept as numpy), though token ids may be numpy ints."""
    params = SamplingParams(**changes)  # type: ignore[arg-type]
    for name, value in stored.items():
        assert getattr(params, name) == value
        assert type(getattr(params, name)) is type(value), name


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"max_tokens": np.True_}, TypeError),
        ({"max_tokens": np.float64(2.0)}, TypeError),
        ({"max_tokens": np.int64(0)}, ValueError),
        ({"seed": np.int8(-2)}, ValueError),
        ({"temperature": np.float32("nan")}, ValueError),
        ({"temperature": np.bool_(False)}, TypeError),
    ],
)
def test_numpy_numbers_are_checked_as_python_ones(
    changes: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error, match=next(iter(changes))):
        SamplingParams(**changes)  # type: ignore[arg-type]


def test_stop_token_ids_may_be_a_numpy_array() -> None:
    """Regression: a numpy array of stop ids was refused as 'stop_token_ids must be a
    sequence of token ids', though a prompt may be one."""
    params = SamplingParams(stop_token_ids=np.array([3, 5], dtype=np.int32))  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 5)
    assert all(type(t) is int for t in params.stop_token_ids)
    with pytest.raises(TypeError, match=r"must hold int token ids, got \[1\.5\]"):
        SamplingParams(stop_token_ids=np.array([1.5]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a sequence of token ids"):
        SamplingParams(stop_token_ids=np.array([[1, 2]]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        SamplingParams(stop_token_ids=np.array([-1]))  # type: ignore[arg-type]


def test_stop_token_ids_may_be_none_as_in_vllm() -> None:
    """Regression: `stop_token_ids=None`, vLLM's default (code written for it passes it
    through), was refused as 'stop_token_ids must be a sequence of token ids'."""
    params = SamplingParams(stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop_token_ids == ()
    assert params == SamplingParams()


@pytest.mark.parametrize("seed", [-1, np.int64(-1)])
def test_seed_minus_one_means_no_seed_as_in_vllm(seed: object) -> None:
    """Regression: `seed=-1`, vLLM's "no seed" (its SamplingParams stores None), was
    refused as 'seed must be in [0, 2**63), got -1', so code written for vLLM failed."""
    params = SamplingParams(temperature=1.0, seed=seed)  # type: ignore[arg-type]
    assert params.seed is None
    assert params == SamplingParams(temperature=1.0)
    source = _source()
    generator = params.make_generator(source)
    assert generator is not None
    assert not torch.equal(source.get_state(), _source().get_state())  # drew, as unseeded


@pytest.mark.parametrize("temperature", [2.0001, 3, 100.0, np.float32(2.5)])
def test_a_temperature_above_two_is_refused_as_in_vllm(temperature: object) -> None:
    """Regression: any finite temperature was taken, where vLLM's SamplingParams refuses
    one above 2 ('temperature must be in [0, 2]'): a request vLLM refuses ran here."""
    with pytest.raises(ValueError, match=rf"temperature must be in \[0, 2\], got {temperature}"):
        SamplingParams(temperature=temperature)  # type: ignore[arg-type]
    assert SamplingParams(temperature=2).temperature == 2.0


@pytest.mark.parametrize("ignore_eos", [np.True_, np.False_])
def test_ignore_eos_may_be_a_numpy_bool(ignore_eos: np.bool_) -> None:
    """Regression: `ignore_eos=np.True_` was refused as 'ignore_eos must be a bool', though
    numpy numbers are taken for the other fields."""
    params = SamplingParams(ignore_eos=ignore_eos)  # type: ignore[arg-type]
    assert params.ignore_eos is bool(ignore_eos)
    assert params == SamplingParams(ignore_eos=bool(ignore_eos))
