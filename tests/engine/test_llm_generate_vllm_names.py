"""`generate` takes vLLM's argument names, `sampling_params=` and `use_tqdm=`, beside its
own `params=` and `show_progress=`.

Regression: code written for vLLM's `LLM.generate(prompts, sampling_params=...,
use_tqdm=False)` failed with "unexpected keyword argument".
"""

from __future__ import annotations

from typing import Any

import pytest

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
