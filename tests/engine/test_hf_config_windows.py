"""Sliding windows read from config.json as transformers reads them.

Regression: a LlamaForCausalLM config.json with a `sliding_window` key made every layer
slide (transformers' Llama never does), and a Qwen2 one without `use_sliding_window`
slid too (Qwen2Config defaults it to false), so past the window the engine's logits
differed from the checkpoint's own (by about 3 on a tiny model); Qwen2's defaults for an
absent `max_window_layers` (28) and `sliding_window` (4096) were not transformers' either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.config import AttentionKind, ModelConfig

FULL, SLIDING = AttentionKind.FULL, AttentionKind.SLIDING
NUM_LAYERS = 30

CASES: dict[str, dict[str, Any]] = {
    "llama with a window key": {"architectures": ["LlamaForCausalLM"], "sliding_window": 4},
    "qwen2 without use_sliding_window": {"sliding_window": 4, "max_window_layers": 0},
    "qwen2 window on, default layers": {"use_sliding_window": True, "sliding_window": 4},
    "qwen2 window on, default size": {"use_sliding_window": True, "max_window_layers": 1},
    "qwen2 window on, null size": {"use_sliding_window": True, "sliding_window": None},
    # s32 mutation run: both of these went unpinned.
    "llama with use_sliding_window": {
        "architectures": ["LlamaForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 0,
    },
    "qwen2 window on every layer": {
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 0,
    },
}
EXPECTED: dict[str, tuple[int | None, tuple[AttentionKind, ...]]] = {
    "llama with a window key": (None, (FULL,) * NUM_LAYERS),
    "qwen2 without use_sliding_window": (None, (FULL,) * NUM_LAYERS),
    "qwen2 window on, default layers": (4, (FULL,) * 28 + (SLIDING,) * 2),
    "qwen2 window on, default size": (4096, (FULL,) + (SLIDING,) * 29),
    "qwen2 window on, null size": (None, (FULL,) * NUM_LAYERS),
    "llama with use_sliding_window": (None, (FULL,) * NUM_LAYERS),
    "qwen2 window on every layer": (4, (SLIDING,) * NUM_LAYERS),
}


def _write(tmp_path: Path, overrides: dict[str, Any]) -> Path:
    hf: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **overrides,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("case", CASES)
def test_windows_follow_transformers_defaults(tmp_path: Path, case: str) -> None:
    config = ModelConfig.from_hf_config(_write(tmp_path, CASES[case]))
    assert (config.sliding_window, config.layer_kinds) == EXPECTED[case]


@pytest.mark.parametrize("case", CASES)
def test_windows_match_transformers_config(tmp_path: Path, case: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _write(tmp_path, CASES[case])
    llama = CASES[case].get("architectures") == ["LlamaForCausalLM"]
    config_class = transformers.LlamaConfig if llama else transformers.Qwen2Config
    hf = config_class.from_pretrained(path)
    config = ModelConfig.from_hf_config(path)
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * NUM_LAYERS
    kinds = tuple(SLIDING if t == "sliding_attention" else FULL for t in layer_types)
    assert config.layer_kinds == kinds
    if SLIDING in kinds:
        assert config.sliding_window == hf.sliding_window
