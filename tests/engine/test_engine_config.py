"""ModelConfig validation, presets, KV groups and reading HF config.json files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.config import AttentionKind, CacheConfig, ModelConfig

FULL, SLIDING = AttentionKind.FULL, AttentionKind.SLIDING


def _write(tmp_path: Path, **overrides: Any) -> Path:
    hf: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "eos_token_id": [5, 7],
        "use_sliding_window": True,  # Qwen2's default is off (test_hf_config_windows)
    }
    hf.update(overrides)
    hf = {k: v for k, v in hf.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def test_presets_are_valid_and_grouped() -> None:
    assert [g.kind for g in ModelConfig.tiny().layer_groups()] == [FULL]
    full, sliding = ModelConfig.tiny_hybrid().layer_groups()
    assert (full.group_id, full.layer_ids, full.sliding_window) == (0, (0,), None)
    assert (sliding.group_id, sliding.layer_ids, sliding.sliding_window) == (1, (1,), 8)
    demo = ModelConfig.demo()
    assert demo.kv_bytes_per_token() == 2 * demo.num_layers * demo.num_kv_heads * demo.head_dim * 4


def test_all_sliding_model_has_one_group() -> None:
    config = dataclasses.replace(ModelConfig.tiny(), layer_kinds=(SLIDING,) * 2, sliding_window=4)
    (group,) = config.layer_groups()
    assert (group.group_id, group.kind, group.layer_ids) == (0, SLIDING, (0, 1))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
        ({"num_kv_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"layer_kinds": (FULL,)}, "layer_kinds has 1 entries for num_layers=2"),
        ({"layer_kinds": (FULL, SLIDING)}, "positive int sliding_window, got None"),
        ({"sliding_window": 4}, "sliding_window=4 but no layer is SLIDING"),
        ({"rope_theta": 0.0}, "rope_theta=0.0"),
    ],
)
def test_invalid_model_config_names_the_value(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.tiny(), **changes)


def test_invalid_cache_config() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="num_blocks=1 leaves no block"):
        CacheConfig(num_blocks=1)


def test_qwen2_sliding_layers_from_max_window_layers(tmp_path: Path) -> None:
    path = _write(tmp_path, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    config = ModelConfig.from_hf_config(path)
    assert config.layer_kinds == (FULL, FULL, SLIDING, SLIDING)
    assert config.sliding_window == 16
    assert config.qkv_bias
    assert not config.o_proj_bias
    assert config.head_dim == 16
    assert config.rope_theta == 1e6
    assert config.eos_token_ids == (5, 7)


def test_layer_types_take_precedence(tmp_path: Path) -> None:
    types = ["sliding_attention", "full_attention"] * 2
    path = _write(tmp_path, sliding_window=8, max_window_layers=0, layer_types=types)
    assert ModelConfig.from_hf_config(path / "config.json").layer_kinds == (SLIDING, FULL) * 2


def test_disabled_sliding_window_means_full_attention(tmp_path: Path) -> None:
    path = _write(tmp_path, use_sliding_window=False, sliding_window=4096, max_window_layers=2)
    config = ModelConfig.from_hf_config(path)
    assert config.layer_kinds == (FULL,) * 4
    assert config.sliding_window is None


def test_llama_with_old_style_rope_theta(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        architectures=["LlamaForCausalLM"],
        rope_parameters=None,
        rope_theta=500000.0,
        head_dim=32,
        attention_bias=True,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    config = ModelConfig.from_hf_config(path)
    assert config.rope_theta == 500000.0
    assert config.head_dim == 32
    assert config.qkv_bias
    assert config.o_proj_bias
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r'architectures=\["GPT2LMHeadModel"\]'),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            'rope_type="llama3" not supported',
        ),
        (  # the legacy key and its legacy "type" (s32 mutation run: both went unread)
            {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
            'rope_type="linear" not supported',
        ),
        ({"hidden_act": "gelu"}, 'hidden_act="gelu" not supported'),
        ({"mlp_bias": True}, "mlp_bias=true not supported"),
        (
            {"sliding_window": 8, "layer_types": ["chunked_attention"] * 4},
            'layer_types "chunked_attention" not supported',
        ),
    ],
)
def test_unsupported_hf_configs_are_rejected(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_write(tmp_path, **overrides))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "expected a JSON object, got list"),
        ('{"num_attention_heads": 0}', "num_attention_heads must be a positive int, got 0"),
        ('{"hidden_size": "abc"}', 'hidden_size must be a positive int, got "abc"'),
        ('{"num_hidden_layers": 2.5}', "num_hidden_layers must be a positive int, got 2.5"),
        ('{"rope_parameters": 5}', r"rope_parameters \(or rope_scaling\) must be an object"),
        ('{"architectures": 5}', "architectures must be a list, got 5"),
        (
            '{"rope_parameters": {"rope_theta": "x"}}',
            'rope_theta must be a finite number > 0, got "x"',
        ),
        ('{"num_key_value_heads": 0}', "num_key_value_heads must be a positive int, got 0"),
        ('{"eos_token_id": "2"}', 'eos_token_id must be a token id or a list of them, got "2"'),
        (
            '{"sliding_window": 8, "max_window_layers": "2"}',
            'max_window_layers must be an int >= 0, got "2"',
        ),
        ('{"sliding_window": 8, "layer_types": 5}', "layer_types must be a list, got 5"),
    ],
)
def test_a_malformed_hf_config_is_a_value_error_naming_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    """Regression: `kvtier demo --model-dir` whose config.json was a list, had
    num_attention_heads 0 or a number for rope_parameters, ended in an AttributeError or
    ZeroDivisionError traceback; a number for architectures or layer_types, or a string
    for rope_theta or max_window_layers, gave a message that named no key; a string
    eos_token_id was accepted, and num_key_value_heads 0 was taken as absent."""
    path = _write(tmp_path)
    if text != "[]":
        hf = json.loads(path.joinpath("config.json").read_text())
        text = json.dumps({**hf, **json.loads(text)})
    path.joinpath("config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rms_norm_eps": "x"}, 'rms_norm_eps must be a finite number > 0, got "x"'),
        ({"vocab_size": "abc"}, 'vocab_size must be a positive int, got "abc"'),
        ({"head_dim": "64"}, 'head_dim must be a positive int, got "64"'),
        ({"max_position_embeddings": 1.5}, "max_position_embeddings must be a positive int"),
        (
            {"tie_word_embeddings": "false"},
            'tie_word_embeddings must be true or false, got "false"',
        ),
        ({"attention_bias": 1}, "attention_bias must be true or false, got 1"),
        (
            {"sliding_window": "8", "layer_types": ["sliding_attention"] * 4},
            'sliding_window must be a positive int, got "8"',
        ),
        ({"num_key_value_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_with_its_file_and_key(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    """Regression: a string rms_norm_eps was a TypeError from a comparison; a string
    vocab_size or head_dim was named by ModelConfig's field, not by the file and key;
    `"tie_word_embeddings": "false"` was read as true, so lm_head.weight was ignored."""
    path = _write(tmp_path, **overrides)
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf_config(path)
    assert str(error.value).startswith(f"{path / 'config.json'}: ")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"tie_word_embeddings": "yes"}', 'tie_word_embeddings must be true or false, got "yes"'),
        ('{"head_dim": null, "hidden_size": true}', "hidden_size must be a positive int, got true"),
        ('{"architectures": ["Gpt\u00e9"]}', 'architectures=["Gpt\u00e9"] not supported'),
        (
            '{"rope_parameters": {"rope_theta": NaN}}',
            "rope_theta must be a finite number > 0, got NaN",
        ),
        ('{"rope_parameters": {"rope_theta": 0}}', "rope_theta must be a finite number > 0, got 0"),
        ('{"rms_norm_eps": 1e400}', "rms_norm_eps must be a finite number > 0, got Infinity"),
        ('{"layer_types": [1, null, "full_attention", 1]}', "layer_types 1, null not supported"),
    ],
)
def test_a_bad_value_is_shown_as_json(tmp_path: Path, text: str, message: str) -> None:
    """Regression: config.json values were shown as Python shows what the JSON reader
    made of them (`True`, `None`, `'yes'`, `['1', 'None']`), not as the file holds them;
    a NaN or zero rope_theta or rms_norm_eps was named as `ModelConfig.rope_theta=nan`."""
    path = _write(tmp_path)
    hf = json.loads(path.joinpath("config.json").read_text())
    path.joinpath("config.json").write_text(json.dumps({**hf, **json.loads(text)}))
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf_config(path)
    assert str(error.value).startswith(f"{path / 'config.json'}: ")
    assert message in str(error.value)


def test_null_optional_values_take_their_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    nulls = ("head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    (path / "config.json").write_text(json.dumps({**hf, **dict.fromkeys(nulls)}))
    config = ModelConfig.from_hf_config(path)
    assert (config.head_dim, config.rms_norm_eps) == (16, 1e-6)
    assert (config.max_position, config.tie_word_embeddings) == (32768, False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"eos_token_ids": 2}, "eos_token_ids must be a tuple of token ids"),
        ({"eos_token_ids": (2, -1)}, r"ints >= 0\), got \(2, -1\)"),
        ({"eos_token_ids": [2]}, r"got \[2\]"),
        ({"layer_kinds": (FULL, SLIDING), "sliding_window": True}, "got True"),
    ],
)
def test_eos_ids_and_a_bool_window_are_checked(changes: dict[str, Any], message: str) -> None:
    """Regression: `eos_token_ids=2` was accepted and the first sampled token raised a
    TypeError inside the step (its requests aborted); `sliding_window=True` was taken
    as a window of 1."""
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.tiny(), **changes)
