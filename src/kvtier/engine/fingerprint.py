"""What the reference engine's KV bytes depend on, as one string (a persistent tier's key).

A persistent disk tier is reused only by an engine whose fingerprint is identical:
- the same model shape and dtype;
- the same weights: random weights, the seed; a checkpoint, its resolved path and, for
  every file in it, its size, modification time, inode and status-change time (a file
  replaced or rewritten in place gets a new inode or ctime, even when its size and mtime
  were kept, as `cp -p`, `rsync -a` or reproducible builds do; no user can set either);
- the same KV layout and the same device type (CPU and CUDA kernels round differently);
- the same block hashing: algorithm, block size and a digest of the root hash (which
  stands for the seed; the root itself stays out of files and logs);
- the same kvtier release: a release may change the model code or how KV lies inside a
  block without changing any size, so a cache outlives no upgrade.
The string is readable JSON, so a mismatch warning can name what changed
(`storage.manifest` compares the two documents key by key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from kvtier import __version__
from kvtier.core.hashing import BlockHasher
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.config import ModelConfig


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
    shape = {f.name: str(getattr(model, f.name)) for f in dataclasses.fields(model)}
    groups = [
        [g.kind.value, g.block_size, g.bytes_per_block, g.sliding_window] for g in layout.groups
    ]
    root_digest = hashlib.sha256(b"kvtier fingerprint\0" + hasher.root_hash).hexdigest()[:32]
    document = {
        "kvtier": __version__,
        "device": device_type,
        "model": shape,
        "weights": weights,
        "kv_groups": groups,
        "hash": [hasher.algo.value, hasher.hash_block_size, root_digest],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def _checkpoint_identity(path: Path) -> dict[str, object]:
    root = path.resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    identities = []
    for file in files:
        stat = file.stat()
        identities.append(
            [
                str(file.relative_to(root)),
                stat.st_size,
                stat.st_mtime_ns,
                stat.st_ino,
                stat.st_ctime_ns,
            ]
        )
    return {"path": str(root), "files": identities}
