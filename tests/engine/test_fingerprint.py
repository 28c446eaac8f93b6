"""What a persistent disk tier's fingerprint depends on (engine/fingerprint.py, SPEC §7)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.core.hashing import BlockHasher, HashAlgo
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.fingerprint import kv_fingerprint

LAYOUT = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 1024),))
HALF_DTYPES = (torch.float16, torch.bfloat16)


def fingerprint(source: Path | None, device: str = "cpu", seed: str | None = None) -> str:
    hasher = BlockHasher(4, HashAlgo.SHA256, seed)
    return kv_fingerprint(source, ModelConfig.tiny(), 0, LAYOUT, hasher, device)


def checkpoint(path: Path, content: bytes) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(content)
    return path


def test_an_untouched_checkpoint_keeps_its_fingerprint(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    assert fingerprint(path) == fingerprint(path)


def test_a_checkpoint_rewritten_in_place_with_its_size_and_mtime_changes_it(
    tmp_path: Path,
) -> None:
    """Regression (review): only path, size and mtime were compared, so another model
    copied over the checkpoint with `cp -p` (same sizes, mtimes kept) got the old KV."""
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    weights = path / "model.safetensors"
    before = fingerprint(path)
    stat = weights.stat()
    weights.write_bytes(b"B" * 64)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert fingerprint(path) != before


def test_a_checkpoint_replaced_by_a_rename_changes_it(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    weights = path / "model.safetensors"
    before = fingerprint(path)
    stat = weights.stat()
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"B" * 64)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    other.replace(weights)
    assert fingerprint(path) != before


def test_metadata_changes_and_a_move_keep_it(tmp_path: Path) -> None:
    """Regression (review): with inode and ctime in it, `chmod` or a hard link to a
    weights file discarded the cache; the contents decide now."""
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    before = fingerprint(path)
    weights = path / "model.safetensors"
    weights.chmod(0o444)
    os.link(weights, tmp_path / "linked")
    assert fingerprint(path) == before
    moved = path.rename(tmp_path / "moved")
    assert fingerprint(moved) == before


def test_the_files_the_engine_reads_are_named_by_their_paths(tmp_path: Path) -> None:
    """config.json and the weights loaded (an index's shards); other files change no KV
    and are not read (a repository's `original/` copy of the weights can be large)."""
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    files = json.loads(fingerprint(path))["weights"]["files"]
    assert list(files) == ["config.json", "model.safetensors"]
    assert files["model.safetensors"].startswith("64:")
    before = fingerprint(path)
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"C" * 64)
    (path / "README.md").write_text("a model")
    assert fingerprint(path) == before
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert list(json.loads(fingerprint(path))["weights"]["files"]) == [
        "config.json",
        "model-00001-of-00001.safetensors",
    ]


def test_release_device_and_hashing_are_in_it_but_not_the_root_hash() -> None:
    document = json.loads(fingerprint(None))
    assert document["kvtier"] == kvtier.__version__
    assert document["device"] == "cpu"
    assert fingerprint(None, device="cuda") != fingerprint(None)
    assert fingerprint(None, seed="a") != fingerprint(None, seed="b")
    root = BlockHasher(4, HashAlgo.SHA256, None).root_hash.hex()
    assert root not in fingerprint(None)  # it stands for the hash seed: kept out of files


def test_a_random_models_seed_is_in_it_a_checkpoints_is_not(tmp_path: Path) -> None:
    """Random weights from another seed give other KV; a checkpoint's weights are its
    files. Mutant (s35): the seed left out (a constant) passed every test."""
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    model = ModelConfig.tiny()
    assert kv_fingerprint(None, model, 1, LAYOUT, hasher, "cpu") != kv_fingerprint(
        None, model, 2, LAYOUT, hasher, "cpu"
    )
    path = checkpoint(tmp_path / "ckpt", b"A" * 64)
    assert kv_fingerprint(path, model, 1, LAYOUT, hasher, "cpu") == kv_fingerprint(
        path, model, 2, LAYOUT, hasher, "cpu"
    )


LAYOUT_CHANGES = {
    "block size": KVGroupSpec(GroupKind.FULL_ATTENTION, 8, 1024),
    "bytes per block": KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 2048),
    "kind": KVGroupSpec(GroupKind.STATE, 4, 1024),
}


@pytest.mark.parametrize("change", LAYOUT_CHANGES)
def test_each_value_of_the_kv_layout_changes_it(change: str) -> None:
    """How KV lies in a block is part of what a block's bytes mean (SPEC §7). Mutants
    (s35): each of a group's kind, block size, bytes per block and window, and the
    groups as a whole, left out passed every test."""
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    model = ModelConfig.tiny()
    other = KVLayout((LAYOUT_CHANGES[change],))
    assert kv_fingerprint(None, model, 0, other, hasher, "cpu") != kv_fingerprint(
        None, model, 0, LAYOUT, hasher, "cpu"
    )


def test_a_sliding_groups_window_changes_it() -> None:
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    model = ModelConfig.tiny()
    eight, sixteen = (
        KVLayout((KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 1024, window),)) for window in (8, 16)
    )
    assert kv_fingerprint(None, model, 0, eight, hasher, "cpu") != kv_fingerprint(
        None, model, 0, sixteen, hasher, "cpu"
    )


def test_the_hash_algorithm_and_block_size_are_in_it() -> None:
    """Blocks keyed by another hashing are another cache. Mutants (s35): the algorithm
    or the hash block size left out passed every test."""
    model = ModelConfig.tiny()
    hashers = [BlockHasher(4, HashAlgo.SHA256, None), BlockHasher(4, HashAlgo.XXHASH, None)]
    hashers.append(BlockHasher(8, HashAlgo.SHA256, None))
    documents = [json.loads(kv_fingerprint(None, model, 0, LAYOUT, h, "cpu")) for h in hashers]
    assert [d["hash"][:2] for d in documents] == [["sha256", 4], ["xxhash", 4], ["sha256", 8]]


def test_the_torch_release_is_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another torch release's kernels may round differently, as another device's do."""
    before = fingerprint(None)
    assert json.loads(before)["torch"] == torch.__version__
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert fingerprint(None) != before


def test_eos_ids_which_change_no_kv_keep_the_fingerprint() -> None:
    """Regression (review): the model's EOS ids were part of it, so a
    generation_config.json added beside a checkpoint (its end-of-turn id joins the EOS
    ids, and is reported as a stop token) made the persistent disk tier drop every block,
    though no KV byte changed. Mutant (s35): the stop-token ids kept in it passed."""
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    model = ModelConfig.tiny()
    eos = (*model.eos_token_ids, 5)
    other = dataclasses.replace(model, eos_token_ids=eos, eos_stop_token_ids=(5,))
    assert model != other
    assert kv_fingerprint(None, other, 0, LAYOUT, hasher, "cpu") == kv_fingerprint(
        None, model, 0, LAYOUT, hasher, "cpu"
    )
    wider = dataclasses.replace(model, hidden_size=2 * model.hidden_size)
    assert kv_fingerprint(None, wider, 0, LAYOUT, hasher, "cpu") != kv_fingerprint(
        None, model, 0, LAYOUT, hasher, "cpu"
    )


KV_CHANGES = {
    "vocab_size": {"vocab_size": 256},
    "hidden_size": {"hidden_size": 128},
    "intermediate_size": {"intermediate_size": 256},
    "num_layers": {"num_layers": 3, "layer_kinds": (AttentionKind.FULL,) * 3},
    "num_heads": {"num_heads": 8},
    "num_kv_heads": {"num_kv_heads": 4},
    "head_dim": {"head_dim": 32},
    "sliding layers": {"layer_kinds": ModelConfig.tiny_hybrid().layer_kinds, "sliding_window": 8},
    "rope_theta": {"rope_theta": 500000.0},
    "rms_norm_eps": {"rms_norm_eps": 1e-5},
    "qkv_bias": {"qkv_bias": True},
    "o_proj_bias": {"o_proj_bias": True},
}


@pytest.mark.parametrize("change", KV_CHANGES)
def test_each_model_value_the_kv_depends_on_changes_it(change: str) -> None:
    """The same KV layout (same bytes per block), another model: the cached KV is not its
    own. Mutants (s32 mutation run): rope_theta or the dtype left out passed every test."""
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    model = ModelConfig.tiny()
    other = dataclasses.replace(model, **KV_CHANGES[change])
    assert kv_fingerprint(None, other, 0, LAYOUT, hasher, "cpu") != kv_fingerprint(
        None, model, 0, LAYOUT, hasher, "cpu"
    )


def test_a_dtype_of_the_same_size_changes_it() -> None:
    """float16 and bfloat16 KV blocks have the same size but other bytes."""
    hasher = BlockHasher(4, HashAlgo.SHA256, None)
    half, brain = (dataclasses.replace(ModelConfig.tiny(), dtype=d) for d in HALF_DTYPES)
    assert kv_fingerprint(None, half, 0, LAYOUT, hasher, "cpu") != kv_fingerprint(
        None, brain, 0, LAYOUT, hasher, "cpu"
    )


def test_a_change_past_the_first_chunk_of_a_weights_file_changes_it(tmp_path: Path) -> None:
    """Every byte is digested. Mutant (s32): only each chunk's first 16 bytes digested
    passed every test (each rewrite changed the first bytes)."""
    content = bytearray(b"A" * ((8 << 20) + 64))
    path = checkpoint(tmp_path / "ckpt", bytes(content))
    before = fingerprint(path)
    assert json.loads(before)["weights"]["files"]["model.safetensors"].startswith(
        f"{len(content)}:"  # the whole file's size (mutant s35: the last chunk's)
    )
    for offset in (len(content) - 1, 5000):  # mutant s35: a chunk's first 4 KiB digested
        changed = bytearray(content)
        changed[offset] = ord("B")
        (path / "model.safetensors").write_bytes(bytes(changed))
        assert fingerprint(path) != before
