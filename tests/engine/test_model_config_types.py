"""ModelConfig refuses, naming the field, values that would silently change the model.

Regression: a NaN `rope_theta` or `rms_norm_eps` (also from a config.json, whose JSON
reader takes `NaN`) was accepted and every logit came out NaN; an infinite one too;
`tie_word_embeddings="false"` (or qkv_bias / o_proj_bias) was truthy, so the model tied
its embeddings or grew biases; a string rope_theta or dtype was a TypeError or
AttributeError naming no field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_HF_CONFIG

from kvtier.engine.config import ModelConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_theta": float("nan")}, "ModelConfig.rope_theta=nan must be a finite number > 0"),
        ({"rope_theta": float("inf")}, "ModelConfig.rope_theta=inf must be a finite number > 0"),
        ({"rope_theta": "1e4"}, "ModelConfig.rope_theta='1e4' must be a finite number > 0"),
        ({"rope_theta": True}, "ModelConfig.rope_theta=True must be a finite number > 0"),
        ({"rms_norm_eps": float("nan")}, "ModelConfig.rms_norm_eps=nan must be a finite"),
        ({"tie_word_embeddings": "false"}, "ModelConfig.tie_word_embeddings must be a bool"),
        ({"qkv_bias": 1}, "ModelConfig.qkv_bias must be a bool, got 1"),
        ({"o_proj_bias": None}, "ModelConfig.o_proj_bias must be a bool, got None"),
        ({"dtype": "float32"}, "ModelConfig.dtype must be a floating point torch.dtype"),
    ],
)
def test_bad_values_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.tiny(), **changes)


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
def test_a_nan_in_config_json_is_refused(tmp_path: Path, key: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, key: float("nan")}))
    with pytest.raises(
        ValueError, match=f"config.json: {key} must be a finite number > 0, got NaN"
    ):
        ModelConfig.from_hf_config(tmp_path)


def test_integer_theta_and_eps_are_accepted() -> None:
    config = dataclasses.replace(ModelConfig.tiny(), rope_theta=500000, rms_norm_eps=1)
    assert (config.rope_theta, config.rms_norm_eps) == (500000, 1)
