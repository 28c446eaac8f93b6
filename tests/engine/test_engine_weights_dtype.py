"""A checkpoint tensor that is not floating point (a quantized weight) is refused, named.

Regression: `load_weights` cast any dtype into the model's, so an int8 weight of the
right shape (a quantized checkpoint without its scales) loaded silently as integers and
the model ran with garbage weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.model import build_model
from kvtier.engine.weights import load_model

QUANTIZED = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.bool])
def test_a_non_float_tensor_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    tensors[QUANTIZED] = torch.ones_like(tensors[QUANTIZED], dtype=dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    message = f"model.safetensors: {QUANTIZED} is {dtype}, not floating point"
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_float_tensors_of_another_precision_are_cast(tmp_path: Path) -> None:
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{n}": p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    loaded = load_model(tmp_path)
    assert loaded.embed_tokens.weight.dtype == torch.float32
    expected = model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.embed_tokens.weight, expected)


def test_the_model_takes_the_dtype_and_device_asked_for(tmp_path: Path) -> None:
    """`load_model(dtype=..., device=...)` builds the model in that dtype on that device
    (the meta device stands for a GPU here). Mutants (s32): the dtype or the device
    dropped (a float32 model on the CPU) passed every test."""
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.config.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    expected = model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(loaded.embed_tokens.weight, expected)
    on_meta = load_model(tmp_path, device="meta")
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
