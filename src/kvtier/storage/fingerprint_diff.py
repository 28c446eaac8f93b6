"""What changed between the fingerprint a persistent tier was written with and this
engine's, for the warning that discards the tier.

A fingerprint is opaque to the storage layer, but the reference engine's is JSON
(`engine.fingerprint`): when both are JSON objects the difference is named key by key
(`model.dtype: 'torch.float32' -> 'torch.bfloat16'`), since their first 80 characters
are usually the same.
"""

from __future__ import annotations

import json

MAX_NAMED = 4  # differences named in one message; the rest are counted
MAX_VALUE_CHARS = 60


def describe_difference(stored: str, current: str) -> str:
    """Return how `stored` differs from `current`, naming the changed keys when both are
    JSON objects (a key one side lacks shows as null), else the two values shortened."""
    try:  # a document nested too deep to parse or walk is shown as text
        old, new = _json_object(stored), _json_object(current)
        if old is None or new is None:
            return f"fingerprint {_short(stored)} differs from {_short(current)}"
        old_leaves, new_leaves = _leaves(old), _leaves(new)
    except RecursionError:
        return f"fingerprint {_short(stored)} differs from {_short(current)}"
    changed = [
        f"{path}: {_short(old_leaves.get(path))} -> {_short(new_leaves.get(path))}"
        for path in sorted(old_leaves.keys() | new_leaves.keys())
        if old_leaves.get(path) != new_leaves.get(path)
    ]
    if not changed:  # the same document, written differently
        return f"fingerprint {_short(stored)} differs from {_short(current)}"
    more = len(changed) - MAX_NAMED
    named = "; ".join(changed[:MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")
    return f"fingerprint changed (stored -> this engine): {named}"


def _json_object(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _leaves(value: object, path: str = "") -> dict[str, object]:
    """Return {dotted path: value} of every leaf (list items by index: `files.3.1`)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = [(str(i), item) for i, item in enumerate(value)]
    else:
        return {path: value}
    leaves: dict[str, object] = {}
    for key, item in items:
        leaves.update(_leaves(item, f"{path}.{key}" if path else str(key)))
    return leaves


def _short(value: object) -> str:
    """A string quoted (shortened), anything else as JSON writes it."""
    if not isinstance(value, str):
        return json.dumps(value)
    return repr(value if len(value) <= MAX_VALUE_CHARS else value[: MAX_VALUE_CHARS - 3] + "...")
