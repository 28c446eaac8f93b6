"""A checkpoint's `generation_config.json` sets `generate`'s default sampling params, as
vLLM's `LLM.get_default_sampling_params` does: used when a call gives no params.

Regression: `generate(prompts)` on a chat checkpoint (Qwen2.5-Instruct's file: temperature
0.7, top_p 0.8, top_k 20) sampled greedily, where vLLM samples with the file's values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.generation_defaults import default_sampling_params
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.model import build_model
from kvtier.engine.sampling import SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
ENGINE = EngineConfig(num_gpu_blocks=32)


def _checkpoint(path: Path, generation: dict[str, Any] | None) -> Path:
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "eos_token_id": None}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_generate_without_params_samples_with_the_generation_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    generation = {
        "temperature": 2.0,
        "top_p": 0.95,
        "top_k": 20,
        "max_new_tokens": 6,
        "repetition_penalty": 1.05,
        "do_sample": True,
    }
    path = _checkpoint(tmp_path, generation)
    expected = SamplingParams(
        temperature=2.0, top_p=0.95, top_k=20, max_tokens=6, repetition_penalty=1.05
    )
    with caplog.at_level(logging.WARNING), LLM(path, engine=ENGINE) as llm:
        assert llm.get_default_sampling_params() == expected
        defaulted = [out.output_token_ids for out in llm.generate(PROMPTS)]
    assert "not applied" not in caplog.text
    # The same engine seed and calls sample the same tokens: as given explicitly.
    with LLM(path, engine=ENGINE) as llm:
        explicit = [out.output_token_ids for out in llm.generate(PROMPTS, expected)]
    assert defaulted == explicit
    assert all(len(tokens) == 6 for tokens in defaulted)
    with LLM(path, engine=ENGINE) as llm:  # greedy (the old default) differs
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert defaulted != [out.output_token_ids for out in greedy]


def test_given_params_replace_the_defaults_as_in_vllm(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, {"temperature": 2.0, "top_k": 3, "max_new_tokens": 6})
    given = SamplingParams(max_tokens=3)
    with LLM(path, engine=ENGINE) as llm:
        outputs = [out.output_token_ids for out in llm.generate(PROMPTS, given)]
        assert llm.get_default_sampling_params().max_tokens == 6
    (path / "generation_config.json").unlink()
    with LLM(path, engine=ENGINE) as llm:
        assert [out.output_token_ids for out in llm.generate(PROMPTS, given)] == outputs


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        (None, SamplingParams()),
        ({"eos_token_id": 5}, SamplingParams()),
        # transformers 5 (vLLM 0.33's) defaults every key to None: a top_k of 50 is kept.
        ({"top_k": 50, "temperature": 0.7}, SamplingParams(temperature=0.7, top_k=50)),
        ({"top_k": 50, "top_p": None}, SamplingParams()),  # greedy: top_k off
        ({"temperature": 0.6, "top_p": 0.9}, SamplingParams(temperature=0.6, top_p=0.9)),
        ({"temperature": 0.0, "top_k": 5}, SamplingParams()),  # greedy: filters off
        ({"min_p": 0.1, "temperature": 1.0}, SamplingParams(temperature=1.0, min_p=0.1)),
        # As vLLM's get_diff_sampling_param: the penalties too (greedy ones as well).
        (
            {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -1},
            SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-1.0),
        ),
        ({"repetition_penalty": 1.0, "min_new_tokens": 3}, SamplingParams()),  # not vLLM's
    ],
)
def test_the_defaults_take_the_files_sampling_keys(
    tmp_path: Path, generation: dict[str, Any] | None, expected: SamplingParams
) -> None:
    with LLM(_checkpoint(tmp_path, generation), engine=ENGINE) as llm:
        assert llm.get_default_sampling_params() == expected
    # Named by its config.json, the file beside it is read (mutation: looked for under it).
    assert default_sampling_params(tmp_path / "config.json") == expected
    assert LLM(None, engine=ENGINE).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"temperature": 3}, r"temperature must be in \[0, 2\], got 3"),
        ({"max_new_tokens": 0}, r"max_tokens must be a positive int, got 0"),
        ({"top_k": "20"}, r"top_k must be an int \(0 or -1: off\), got '20'"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be greater than zero, got 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ],
)
def test_a_bad_sampling_value_is_named_with_its_file(
    tmp_path: Path, generation: dict[str, Any], message: str
) -> None:
    path = _checkpoint(tmp_path, generation)
    with pytest.raises(ValueError, match=message) as info:
        LLM(path, engine=ENGINE)
    assert str(info.value).startswith(str(path / "generation_config.json"))


def test_the_files_penalties_apply_to_generate_without_params(tmp_path: Path) -> None:
    """A greedy default with the file's repetition penalty makes the tokens of those
    params given explicitly, not the unpenalized greedy ones."""
    path = _checkpoint(tmp_path, {"repetition_penalty": 20.0, "max_new_tokens": 8})
    plain = SamplingParams(max_tokens=8)
    with LLM(path, engine=ENGINE) as llm:
        defaulted = [out.output_token_ids for out in llm.generate(PROMPTS)]
        penalized = dataclasses.replace(plain, repetition_penalty=20.0)
        assert defaulted == [out.output_token_ids for out in llm.generate(PROMPTS, penalized)]
        assert defaulted != [out.output_token_ids for out in llm.generate(PROMPTS, plain)]


def test_filters_without_a_temperature_stay_greedy_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's default temperature is 1.0 (it would sample with the file's top_p), the
    engine's 0: the file's filters are off, and a warning says so instead of silence."""
    path = _checkpoint(tmp_path, {"top_p": 0.8, "top_k": 20, "max_new_tokens": 4})
    with caplog.at_level(logging.WARNING), LLM(path, engine=ENGINE) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=4)
    assert "sets top_k=20, top_p=0.8 but no temperature: greedy here" in caplog.text
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING),
        LLM(_checkpoint(tmp_path, {"temperature": 0.0, "top_k": 20}), engine=ENGINE),
    ):
        pass
    assert "no temperature" not in caplog.text


def test_the_files_skip_special_tokens_is_taken_or_said_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's defaults take the file's `skip_special_tokens` (`get_diff_sampling_param`).
    The engine makes no text: true is its own default, false (keep them in the text)
    cannot be honoured and is not applied, with a warning naming the file, not refused.

    Regression: the key was dropped without a word."""
    path = _checkpoint(tmp_path, {"skip_special_tokens": False, "max_new_tokens": 4})
    with caplog.at_level(logging.WARNING), LLM(path, engine=ENGINE) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=4)
        (out,) = llm.generate(PROMPTS[:1])
    assert len(out.output_token_ids) <= 4
    expected = f"{path / 'generation_config.json'} sets skip_special_tokens=false: not applied"
    assert expected in caplog.text
    caplog.clear()
    path = _checkpoint(tmp_path, {"skip_special_tokens": True})
    with caplog.at_level(logging.WARNING), LLM(path, engine=ENGINE) as llm:
        assert llm.get_default_sampling_params().skip_special_tokens is True
    assert "skip_special_tokens" not in caplog.text


def test_a_min_p_alone_without_a_temperature_is_warned_of_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """min_p is one of the filters vLLM would sample with. Mutant (s32 mutation run):
    min_p left out of the warning's filters passed every test (a file giving min_p
    alone was left off in silence)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    with caplog.at_level(logging.WARNING):
        default_sampling_params(tmp_path)
    assert "sets min_p=0.1 but no temperature: greedy here" in caplog.text
