"""config.json values that a mutation run (s32) could misread with every test passing,
pinned as transformers 5 reads them (and cross-checked against it where it is installed):
a nested `rope_parameters.rope_theta` wins over a top-level `rope_theta`, a left-out
theta is 10000, a Qwen2's `o_proj` has no bias whatever `attention_bias` says, token
id 0 is an EOS id like any other, and the first supported architecture listed is read
(as vLLM's registry tries them in order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_HF_CONFIG

from kvtier.engine.config import ModelConfig

LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"


def _write(tmp_path: Path, architecture: str, **overrides: Any) -> Path:
    hf = {
        **TINY_HF_CONFIG,
        "architectures": [architecture],
        "model_type": "llama" if architecture == LLAMA else "qwen2",
        **overrides,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _transformers_config(path: Path, architecture: str) -> Any:
    transformers = pytest.importorskip("transformers")
    config_class = transformers.LlamaConfig if architecture == LLAMA else transformers.Qwen2Config
    return config_class.from_pretrained(path)


@pytest.mark.parametrize("architecture", [LLAMA, QWEN2])
def test_a_left_out_rope_theta_is_10000(tmp_path: Path, architecture: str) -> None:
    """Mutant: a default theta of 1e6 (Qwen2-Instruct's value) passed every test."""
    path = _write(tmp_path, architecture)
    assert ModelConfig.from_hf_config(path).rope_theta == 10000.0
    hf = _transformers_config(path, architecture)
    assert ModelConfig.from_hf_config(path).rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("architecture", [LLAMA, QWEN2])
def test_a_nested_rope_theta_wins_over_a_top_level_one(tmp_path: Path, architecture: str) -> None:
    """Mutant: the top-level `rope_theta` taken first passed every test."""
    nested = {"rope_type": "default", "rope_theta": 7.0}
    path = _write(tmp_path, architecture, rope_theta=5.0, rope_parameters=nested)
    assert ModelConfig.from_hf_config(path).rope_theta == 7.0
    hf = _transformers_config(path, architecture)
    assert ModelConfig.from_hf_config(path).rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    ("architecture", "biases"), [(LLAMA, (True, True)), (QWEN2, (True, False))]
)
def test_attention_bias_adds_no_o_proj_bias_to_a_qwen2(
    tmp_path: Path, architecture: str, biases: tuple[bool, bool]
) -> None:
    """transformers' Qwen2Attention gives q/k/v a bias and `o_proj` none, and ignores
    `attention_bias`; Llama's adds a bias to all four. Mutant: `o_proj_bias` read from
    `attention_bias` alone passed every test (a Qwen2 checkpoint would then be refused
    for lacking `o_proj.bias` tensors)."""
    config = ModelConfig.from_hf_config(_write(tmp_path, architecture, attention_bias=True))
    assert (config.qkv_bias, config.o_proj_bias) == biases


def test_token_id_0_is_an_eos_id(tmp_path: Path) -> None:
    """Mutant: EOS ids refused unless > 0 passed every test (token 0 is some
    checkpoints' EOS: such a checkpoint would have been refused)."""
    config = ModelConfig.from_hf_config(_write(tmp_path, LLAMA, eos_token_id=[0, 5]))
    assert (config.eos_token_ids, config.eos_stop_token_ids) == ((0, 5), (5,))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == (0,)


def test_the_first_supported_architecture_listed_is_read(tmp_path: Path) -> None:
    """As vLLM's model registry, which tries `architectures` in order. Mutant (s32):
    only the first entry looked at (the checkpoint refused) passed every test."""
    path = _write(tmp_path, LLAMA)
    hf = json.loads((path / "config.json").read_text())
    hf["architectures"] = ["NotAModelForCausalLM", QWEN2, LLAMA]
    (path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf_config(path)
    assert (config.qkv_bias, config.max_position, config.eos_token_ids) == (True, 32768, ())
