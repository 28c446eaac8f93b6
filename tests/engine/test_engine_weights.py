"""Checkpoint loading: name mapping, sharded files and clear failures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.model import build_model
from kvtier.engine.weights import checkpoint_files, load_model, parameter_name


def _save_checkpoint(path: Path, drop: str | None = None, extra: str | None = None) -> None:
    """Save a random tiny model in HF naming, split over two shards with an index."""
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {
        name if name == "lm_head.weight" else f"model.{name}": p.detach().clone()
        for name, p in model.named_parameters()
    }
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    if drop:
        del tensors[drop]
    if extra:
        tensors[extra] = torch.zeros(1)
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))


def test_sharded_checkpoint_round_trip(tmp_path: Path) -> None:
    _save_checkpoint(tmp_path)
    assert [f.name for f in checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    loaded = load_model(tmp_path)
    original = build_model(ModelConfig.tiny(), seed=3)
    for (name, a), (_, b) in zip(
        loaded.named_parameters(), original.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_name_mapping() -> None:
    assert parameter_name("model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert parameter_name("lm_head.weight") == "lm_head.weight"
    assert parameter_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_missing_parameter_is_named(tmp_path: Path) -> None:
    _save_checkpoint(tmp_path, drop="model.norm.weight")
    with pytest.raises(ValueError, match=r"lacks parameters: \['norm.weight'\]"):
        load_model(tmp_path)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    _save_checkpoint(tmp_path, extra="model.layers.0.mystery")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mystery' has no model parameter"):
        load_model(tmp_path)


def test_never_downloads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("Qwen/Qwen2-0.5B")
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_a_file_is_not_a_checkpoint_directory(tmp_path: Path) -> None:
    """Mutant (s32): a file path taken for the directory was refused for holding no
    *.safetensors files, naming not what was wrong with it."""
    _save_checkpoint(tmp_path)
    not_a_directory = r"config\.json is not a local checkpoint directory"
    with pytest.raises(FileNotFoundError, match=not_a_directory):
        load_model(tmp_path / "config.json")


def test_a_tied_checkpoint_ignores_a_stored_lm_head(tmp_path: Path) -> None:
    """With tied embeddings the output layer is the embedding (transformers ties them
    over a stored `lm_head.weight`). Mutant (s32): a stored one refused as "no model
    parameter" passed every test."""
    tied = dataclasses.replace(ModelConfig.tiny(), tie_word_embeddings=True)
    model = build_model(tied, seed=3)
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["lm_head.weight"] = torch.zeros_like(model.embed_tokens.weight)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = {**TINY_HF_CONFIG, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = load_model(tmp_path)
    assert loaded.lm_head is None
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)


def test_a_tensor_stored_in_two_files_is_refused(tmp_path: Path) -> None:
    """Regression: without an index every *.safetensors file is read, and a stale shard
    beside a newer copy silently won or lost by file name order."""
    _save_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    stale = torch.full((64,), 7.0)  # model.norm.weight of the tiny model
    save_file({"model.norm.weight": stale}, str(tmp_path / "c.safetensors"))
    both = r"'model.norm.weight' is stored in both (a|b)\.safetensors and c\.safetensors"
    with pytest.raises(ValueError, match=both):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{", "is not valid JSON"),
        ('{"weight_map": {}}', "must hold a non-empty object weight_map"),
        ('{"metadata": {}}', "must hold a non-empty object weight_map"),
        ('{"weight_map": ["a.safetensors"]}', "must hold a non-empty object weight_map"),
        ("[1]", "must hold a non-empty object weight_map"),
        ('{"weight_map": {"w": 3}}', "weight_map names 3, not shard file names"),
        ('{"weight_map": {"w": "../a.safetensors"}}', 'names "../a.safetensors", not shard'),
        ('{"weight_map": {"w": null, "v": null}}', "weight_map names null, not shard"),
        ('{"weight_map": {"w": ["a"], "v": 1}}', 'weight_map names 1, ["a"], not shard'),
    ],
)
def test_a_malformed_index_is_named(tmp_path: Path, index: str, message: str) -> None:
    """Regression: a weight_map list was an AttributeError traceback; a missing one was
    reported by `kvtier demo` as config.json lacking a key, bad JSON as config.json's; a
    list among the shard names was a TypeError (unhashable), and bad names were shown as
    Python shows them (`None`, `'../a'`), not as JSON."""
    _save_checkpoint(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(index)
    with pytest.raises(ValueError) as error:
        checkpoint_files(tmp_path)
    assert str(error.value).startswith(str(index_path))
    assert message in str(error.value)


def test_missing_shards_are_named_as_the_index_holds_them(tmp_path: Path) -> None:
    """Regression: shard names read from the index were shown as a Python list
    (`['b.safetensors']`), not as JSON like the index's other bad values."""
    _save_checkpoint(tmp_path)
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r'names missing shards: \["b\.safetensors"\]'):
        checkpoint_files(tmp_path)


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_an_unreadable_shard_is_named(tmp_path: Path, cut: str) -> None:
    """Regression: a truncated or corrupt shard raised safetensors' own error ("Error
    while deserializing header: ..."), which names no file: with a checkpoint of many
    shards the user could not tell which one to download again."""
    _save_checkpoint(tmp_path)
    shard = tmp_path / "b.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"garbage"}.get(cut, b""))
    with pytest.raises(ValueError) as error:
        load_model(tmp_path)
    assert str(error.value).startswith(f"{shard} is not a readable safetensors file (")
