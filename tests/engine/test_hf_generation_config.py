"""A checkpoint's `generation_config.json` gives its `eos_token_id`s as EOS tokens.

Regression: only config.json's `eos_token_id` stopped generation. Chat checkpoints keep
their end-of-turn token in generation_config.json alone (Qwen2-Instruct: config.json
151643, generation_config.json [151645, 151643]), so their answers ran on to max_tokens,
where vLLM (`SamplingParams.update_from_generation_config`) and transformers stop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.model import build_model
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weights import checkpoint_files

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _save_checkpoint(path: Path, config: dict[str, Any]) -> Path:
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _generate(path: Path, params: SamplingParams) -> tuple[tuple[int, ...], str]:
    with LLM(model=path, engine=EngineConfig(num_gpu_blocks=32)) as llm:
        (output,) = llm.generate([PROMPT], params)
    return output.output_token_ids, output.finish_reason


def test_generation_stops_at_an_eos_token_of_generation_config(tmp_path: Path) -> None:
    path = _save_checkpoint(tmp_path, {**TINY_HF_CONFIG, "eos_token_id": None})
    tokens, reason = _generate(path, SamplingParams(max_tokens=8))
    assert (len(tokens), reason) == (8, "length")
    eos = tokens[3]
    assert eos not in tokens[:3]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [127, eos]}))
    assert _generate(path, SamplingParams(max_tokens=8)) == (tokens[:4], "stop")
    # ignore_eos ignores them as it ignores config.json's, as vLLM does
    assert _generate(path, SamplingParams(max_tokens=8, ignore_eos=True)) == (tokens, "length")


def test_config_json_eos_stops_nothing_beside_a_generation_config(tmp_path: Path) -> None:
    """vLLM's generation config is the file's alone (transformers'
    `GenerationConfig.from_pretrained`): config.json's `eos_token_id` does not stop a
    request there (nor is masked by `min_tokens`) unless the file or the tokenizer
    names it. Regression: the engine stopped at it too, 4 tokens in instead of 8."""
    path = _save_checkpoint(tmp_path, {**TINY_HF_CONFIG, "eos_token_id": None})
    tokens, _ = _generate(path, SamplingParams(max_tokens=8))
    eos = tokens[3]
    assert eos not in tokens[:3]
    _save_checkpoint(tmp_path, {**TINY_HF_CONFIG, "eos_token_id": [127, eos]})
    assert _generate(path, SamplingParams(max_tokens=8)) == (tokens[:4], "stop")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 127}))
    assert _generate(path, SamplingParams(max_tokens=8)) == (tokens, "length")


@pytest.mark.parametrize(
    ("config_eos", "generation", "expected"),
    [
        (2, {"eos_token_id": [7, 2]}, (2, 7)),
        (2, {"eos_token_id": 7}, (2, 7)),
        # The file replaces config.json's EOS ids (vLLM's and transformers' generation
        # config); config.json's first stands for the tokenizer's (no tokenizer files).
        ([2, 5], {"eos_token_id": None}, (2,)),
        ([2, 5], {"eos_token_id": [7]}, (2, 7)),
        (None, {"eos_token_id": [9]}, (9,)),
        (2, {"temperature": 0.6}, (2,)),  # no eos_token_id: config.json's first alone
    ],
)
def test_eos_tokens_are_config_then_generation_config(
    tmp_path: Path, config_eos: Any, generation: dict[str, Any], expected: tuple[int, ...]
) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_HF_CONFIG, "eos_token_id": config_eos})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == expected
    # config.json named as a file reads the generation config beside it too
    assert ModelConfig.from_hf_config(tmp_path / "config.json").eos_token_ids == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"eos_token_id": "2"}', 'eos_token_id must be a token id or a list of them, got "2"'),
        ('{"eos_token_id": [2, -1]}', r"got \[2, -1\]"),
        ('{"eos_token_id": true}', "got true"),
        ('{"eos_token_id": [2, null]}', r"got \[2, null\]"),
        (r'{"eos_token_id": {"id": "\u00e9"}}', 'got {"id": "\u00e9"}'),  # é, not its escape
        ("[1, 2]", "expected a JSON object, got list"),
        ("{eos", "not valid JSON"),
    ],
)
def test_a_malformed_generation_config_is_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_hf_config(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_a_config_json_that_is_not_json_is_named(tmp_path: Path) -> None:
    """Regression: `LLM` / `read_hf_config` raised json's bare JSONDecodeError ("Expecting
    property name ...: line 1 column 2"), naming no file; only the demo's option check
    named it."""
    (tmp_path / "config.json").write_text("{vocab_size: 128")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON \(Expecting") as info:
        ModelConfig.from_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


@pytest.mark.parametrize(
    "name", ["config.json", "generation_config.json", "model.safetensors.index.json"]
)
def test_a_json_file_that_is_not_utf8_is_named(tmp_path: Path, name: str) -> None:
    """Regression: a checkpoint's JSON file holding a byte that is not UTF-8 (JSON is
    UTF-8) raised the bare UnicodeDecodeError ("'utf-8' codec can't decode byte 0xff in
    position 17"), naming no file, where bad JSON names it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "a"}}')
    (tmp_path / name).write_bytes(b'{"eos_token_id": "\xff"}')
    read = checkpoint_files if name.startswith("model.") else ModelConfig.from_hf_config
    with pytest.raises(ValueError, match="is not valid JSON \\('utf-8' codec") as info:
        read(tmp_path)
    assert str(info.value).startswith(str(tmp_path / name))
