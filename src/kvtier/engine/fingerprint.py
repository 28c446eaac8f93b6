"""What the reference engine's KV bytes depend on, as one string (a persistent tier's key).

A persistent disk tier is reused only by an engine whose fingerprint is identical:
same model shape and dtype, same weights (random weights: the seed; a checkpoint: its
resolved path and the size and modification time of every file in it), same KV layout,
and the same block hashing (algorithm and root hash, which stands for the seed). The
string is readable JSON, so a mismatch warning can be traced by eye.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvtier.core.hashing import BlockHasher
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.config import ModelConfig


def kv_fingerprint(
    source: str | Path | ModelConfig | None,
    model: ModelConfig,
    weights_seed: int,
    layout: KVLayout,
    hasher: BlockHasher,
) -> str:
    """Return the fingerprint of an engine's KV bytes and keys."""
    if isinstance(source, (str, Path)):
        weights: object = _checkpoint_identity(Path(source))
    else:
        weights = {"random_seed": weights_seed}
    shape = {f.name: str(getattr(model, f.name)) for f in dataclasses.fields(model)}
    groups = [
        [g.kind.value, g.block_size, g.bytes_per_block, g.sliding_window] for g in layout.groups
    ]
    document = {
        "model": shape,
        "weights": weights,
        "kv_groups": groups,
        "hash": [hasher.algo.value, hasher.hash_block_size, hasher.root_hash.hex()],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def _checkpoint_identity(path: Path) -> dict[str, object]:
    root = path.resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {
        "path": str(root),
        "files": [
            [str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns] for p in files
        ],
    }
