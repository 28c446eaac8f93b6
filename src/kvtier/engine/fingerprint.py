"""What the reference engine's KV bytes depend on, as one string (a persistent tier's key).

A persistent disk tier is reused only by an engine whose fingerprint is identical:
- the same model shape and dtype (not its EOS ids, which stop generation and change no
  KV: a `generation_config.json` added beside a checkpoint keeps its cache);
- the same weights: random weights, the seed; a checkpoint, the size and content digest
  (xxh3-128) of config.json and each weights file the engine loads, by relative path.
  Contents, not file metadata: a file
  rewritten in place with its size and mtime kept (`cp -p`, `rsync -a`, reproducible
  builds) is caught, while `chmod`, a hard link or a move keeps the cache. Hashing reads
  the files once more right after the weights were loaded from them (page cache: about
  0.3 s per GiB on a 2-core machine);
- the same KV layout and the same device type (CPU and CUDA kernels round differently);
- the same block hashing: algorithm, block size and a digest of the root hash (which
  stands for the seed; the root itself stays out of files and logs);
- the same kvtier release: a release may change the model code or how KV lies inside a
  block without changing any size, so a cache outlives no upgrade;
- the same torch release, for the reason the device type is there: another release's
  kernels may round differently.
The string is readable JSON, so a mismatch warning can name what changed
(`storage.fingerprint_diff` compares the two documents key by key: a changed file by
its path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
import xxhash

from kvtier import __version__
from kvtier.core.hashing import BlockHasher
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.config import ModelConfig
from kvtier.engine.weights import checkpoint_files

_CHUNK_BYTES = 8 << 20
# ModelConfig fields that no KV byte depends on.
_NOT_KV_FIELDS = frozenset({"eos_token_ids", "eos_stop_token_ids"})


def kv_fingerprint(
    source: str | Path | ModelConfig | None,
    model: ModelConfig,
    weights_seed: int,
    layout: KVLayout,
    hasher: BlockHasher,
    device_type: str,
) -> str:
    """Return the fingerprint of an engine's KV bytes and keys (`device_type`: "cpu" or
    "cuda")."""
    if isinstance(source, (str, Path)):
        weights: object = _checkpoint_identity(Path(source))
    else:
        weights = {"random_seed": weights_seed}
    shape = {
        f.name: str(getattr(model, f.name))
        for f in dataclasses.fields(model)
        if f.name not in _NOT_KV_FIELDS
    }
    groups = [
        [g.kind.value, g.block_size, g.bytes_per_block, g.sliding_window] for g in layout.groups
    ]
    root_digest = hashlib.sha256(b"kvtier fingerprint\0" + hasher.root_hash).hexdigest()[:32]
    document = {
        "kvtier": __version__,
        "torch": torch.__version__,
        "device": device_type,
        "model": shape,
        "weights": weights,
        "kv_groups": groups,
        "hash": [hasher.algo.value, hasher.hash_block_size, root_digest],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def _checkpoint_identity(path: Path) -> dict[str, object]:
    """Digest the files the engine reads: config.json and the weights it loads (other
    files, e.g. an `original/` copy in another format, change no KV and may be large)."""
    root = path.resolve()
    files = [root / "config.json", *checkpoint_files(root)]
    return {"files": {str(f.relative_to(root)): _content_digest(f) for f in files}}


def _content_digest(path: Path) -> str:
    """Return "SIZE:XXH3-128" of the file's bytes."""
    digest = xxhash.xxh3_128()
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return f"{size}:{digest.hexdigest()}"
