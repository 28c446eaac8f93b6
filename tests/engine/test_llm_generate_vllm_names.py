"""`generate` takes vLLM's argument names, `sampling_params=` and `use_tqdm=`, beside its
own `params=` and `show_progress=`, and a callable making the progress bar, as vLLM does.

Regression: code written for vLLM's `LLM.generate(prompts, sampling_params=...,
use_tqdm=False)` failed with "unexpected keyword argument".
"""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
from tqdm import tqdm

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5]]
THREE = SamplingParams(max_tokens=3, ignore_eos=True)
TWO = SamplingParams(max_tokens=2, ignore_eos=True)


def small_llm() -> LLM:
    return LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=9))


def tokens(llm: LLM, **kwargs: Any) -> list[tuple[int, ...]]:
    return [out.output_token_ids for out in llm.generate(PROMPTS, **kwargs)]


def test_sampling_params_is_params() -> None:
    llm = small_llm()
    expected = tokens(llm, params=[THREE, TWO])
    assert [len(t) for t in expected] == [3, 2]  # not the defaults' 16
    assert tokens(llm, sampling_params=[THREE, TWO]) == expected
    assert tokens(llm, sampling_params=THREE) == tokens(llm, params=THREE)


@pytest.mark.parametrize(
    ("kwargs", "has_bar"),
    [
        ({}, False),
        ({"use_tqdm": True}, True),
        ({"use_tqdm": False}, False),
        ({"show_progress": True}, True),
    ],
)
def test_use_tqdm_is_show_progress(
    kwargs: dict[str, Any], has_bar: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    small_llm().generate(PROMPTS, THREE, **kwargs)
    assert ("2/2" in capsys.readouterr().err) is has_bar


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": THREE, "sampling_params": THREE}, "both params= and sampling_params="),
        ({"show_progress": True, "use_tqdm": True}, "both show_progress= and use_tqdm="),
        ({"show_progress": False, "use_tqdm": True}, "both show_progress= and use_tqdm="),
    ],
)
def test_both_names_of_one_argument_are_refused(kwargs: dict[str, Any], message: str) -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match=message):
        llm.generate(PROMPTS, **kwargs)
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()


class RecordedBar:
    """A progress bar made by a `use_tqdm` callable: records how it was made and used."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.n = 0
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("name", ["use_tqdm", "show_progress"])
def test_a_callable_makes_the_progress_bar_as_in_vllm(name: str) -> None:
    """Regression: a callable `use_tqdm` (vLLM's bar factory, e.g.
    `functools.partial(tqdm, leave=False)`) was taken as True: the default bar was shown."""
    made: list[RecordedBar] = []

    def make(**kwargs: Any) -> RecordedBar:
        made.append(RecordedBar(**kwargs))
        return made[-1]

    expected = tokens(small_llm(), params=THREE)
    assert tokens(small_llm(), params=THREE, **{name: make}) == expected
    (bar,) = made
    assert bar.kwargs == {"total": 2, "desc": "Processed prompts", "dynamic_ncols": True}
    assert (bar.n, bar.closed) == (2, True)


def test_a_partial_tqdm_use_tqdm_shows_its_bar(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    small_llm().generate(PROMPTS, THREE, use_tqdm=functools.partial(tqdm, file=out))
    assert "Processed prompts" in out.getvalue()
    assert "2/2" in out.getvalue()
    assert capsys.readouterr().err == ""


def test_a_progress_value_of_another_type_is_refused_by_value() -> None:
    llm = small_llm()
    message = r"use_tqdm must be a bool, None or a callable .* got 'yes' \(str\)"
    with pytest.raises(TypeError, match=message):
        llm.generate(PROMPTS, THREE, use_tqdm="yes")  # type: ignore[arg-type]
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()


def test_a_bar_callable_that_fails_leaves_nothing_queued() -> None:
    def broken(**kwargs: Any) -> RecordedBar:
        raise RuntimeError("no terminal")

    llm = small_llm()
    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate(PROMPTS, THREE, use_tqdm=broken)
    assert not llm.scheduler.has_unfinished()
    assert llm.step() == []  # nothing of the failed call is returned later
    assert tokens(llm, params=THREE) == tokens(small_llm(), params=THREE)
