"""Keys a config.json leaves out take transformers' LlamaConfig / Qwen2Config defaults.

Regression: an absent `max_position_embeddings` was 32768 for Llama too (LlamaConfig:
2048, so prompts past the model's length were accepted), an absent `eos_token_id` of a
Llama was no eos (LlamaConfig: 2, so generation ran past it), and an absent
`num_key_value_heads` of a Qwen2 was its query heads (Qwen2Config: 32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.config import ModelConfig

LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama, absent": (LLAMA, {}),
    "llama, null": (LLAMA, {"num_key_value_heads": None, "eos_token_id": None}),
    "qwen2, absent": (QWEN2, {}),
    "qwen2, null": (QWEN2, {"num_key_value_heads": None, "eos_token_id": None}),
}
# (num_kv_heads, max_position, eos_token_ids), as transformers 5 reads them (5.20 and 5.25 checked).
EXPECTED = {
    "llama, absent": (64, 2048, (2,)),
    "llama, null": (64, 2048, ()),
    "qwen2, absent": (32, 32768, ()),
    "qwen2, null": (64, 32768, ()),
}


def _write(tmp_path: Path, architecture: str, overrides: dict[str, Any]) -> Path:
    hf = {
        "architectures": [architecture],
        "model_type": "llama" if architecture == LLAMA else "qwen2",
        "vocab_size": 128,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 64,  # neither config's KV default: 64 or 32 tells them apart
        **overrides,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _read(path: Path) -> tuple[int, int, tuple[int, ...]]:
    config = ModelConfig.from_hf_config(path)
    return config.num_kv_heads, config.max_position, config.eos_token_ids


@pytest.mark.parametrize("case", CASES)
def test_left_out_keys_take_transformers_defaults(tmp_path: Path, case: str) -> None:
    assert _read(_write(tmp_path, *CASES[case])) == EXPECTED[case]


@pytest.mark.parametrize("case", CASES)
def test_left_out_keys_match_transformers_config(tmp_path: Path, case: str) -> None:
    transformers = pytest.importorskip("transformers")
    architecture, overrides = CASES[case]
    path = _write(tmp_path, architecture, overrides)
    config_class = transformers.LlamaConfig if architecture == LLAMA else transformers.Qwen2Config
    hf = config_class.from_pretrained(path)
    eos = hf.eos_token_id
    eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    assert _read(path) == (hf.num_key_value_heads, hf.max_position_embeddings, eos_token_ids)


def test_a_qwen2_default_of_32_kv_heads_must_divide_the_heads(tmp_path: Path) -> None:
    path = _write(tmp_path, QWEN2, {"num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="num_key_value_heads is absent, so Qwen2Config's"):
        ModelConfig.from_hf_config(path)
    (path / "config.json").write_text(
        json.dumps({**json.loads((path / "config.json").read_text()), "num_key_value_heads": 2})
    )
    assert ModelConfig.from_hf_config(path).num_kv_heads == 2
