"""The values of `OffloadConfig`'s fields (see `config`): the mode enums, each field's
type and bounds, and the normalization a value gets before the config holds it; and
`check_known_keys`, which names the closest valid key for a misspelt one (or lists them),
or the key given that it seems to repeat.
"""

from __future__ import annotations

import difflib
import enum
import numbers
import os
from collections.abc import Collection, Iterable, Mapping

from kvtier.core.hashing import HashAlgo
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.offload.config_error import ConfigError

__all__ = [
    "CONFIG_KEYS",
    "FIELD_TYPES",
    "MAX_DISK_BUFFER_SLOTS",
    "CascadeMode",
    "DiskIOMode",
    "StoreMode",
    "as_enum",
    "check_known_keys",
    "check_type",
    "valid_value",
]


class StoreMode(enum.Enum):
    """When blocks are copied down to the tier."""

    EAGER = "eager"  # as soon as their KV is confirmed computed
    LAZY = "lazy"  # only when they are about to be evicted from the GPU


class DiskIOMode(enum.Enum):
    """How the disk tier reads and writes its file."""

    DIRECT = "direct"  # O_DIRECT, 4096-aligned; slot bytes must be a multiple of 4096
    PAGE_CACHE = "page_cache"


class CascadeMode(enum.Enum):
    """How the CPU tier hands blocks down to the disk tier when both are configured.

    WRITE_THROUGH: every block stored in the CPU tier is copied on to disk right after,
    and CPU hits refresh the disk copy (inclusive tiers: the disk keeps a copy of what
    the CPU holds, so a restart with a persistent disk keeps nearly all of it; one disk
    write per stored block; capacity = disk, which must be at least the CPU tier).
    WRITE_BACK: a CPU block is copied to disk only when it nears eviction, then leaves
    the CPU tier (exclusive tiers: capacity = CPU + disk, fewer disk writes; a burst of
    stores larger than the demotion reserve evicts some blocks before their copy).
    """

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


def check_known_keys(
    keys: Iterable[object],
    valid: Collection[str],
    where: str,
    suggest: Collection[str] | None = None,
    instead: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Raise ConfigError naming every key not in `valid`, with the closest valid key;
    when some key has none, the message lists the valid keys.

    `where` names the keys' origin in the message, e.g. "offload config".
    `suggest` (default `valid`) narrows the keys offered and listed to those that go
    with the other keys given (a caller's choice: one spelling of a setting). A key is
    offered only when it is the closest valid key a misspelt key could mean, or (when
    that one is not offered) the key `instead` names in its place (its spelling beside
    the keys given) and close to the misspelt key too; never a runner-up, which is
    another setting (`dis_io_mode` is not `store_mode`). A misspelt key whose closest
    valid key is given too most likely repeats it by a typo: the message says so, and
    offers nothing (`pcu_bytes` beside `cpu_bytes` is no `disk_bytes`). `notes` (key ->
    text) is said after a key offered: that the other keys given would leave it without
    effect.
    """
    given = {str(key) for key in keys}
    unknown = sorted(given - set(valid))
    if not unknown:
        return
    offered = sorted(valid if suggest is None else set(suggest) & set(valid))
    closest = {key: _closest(key, valid) for key in unknown}
    repeated = {key: meant for key, meant in closest.items() if meant in given}
    spellings = {key: other for key, other in (instead or {}).items() if other in valid}
    offers = {
        key: None if key in repeated else _offer(key, meant, given, offered, spellings)
        for key, meant in closest.items()
    }
    named = [
        f"{key} (looks like {repeated[key]!r}, which is given already)"
        if key in repeated
        else _named(key, offer, given, offered, notes or {})
        for key, offer in offers.items()
    ]
    noun = "key" if len(named) == 1 else "keys"
    message = f"unknown {where} {noun}: {', '.join(named)}"
    if any(offer is None and key not in repeated for key, offer in offers.items()):
        which = "valid keys" if len(offered) == len(valid) else "keys valid with the others given"
        message += f"; {which}: {', '.join(offered)}"
    raise ConfigError(message)


def _named(
    key: str,
    offer: str | None,
    given: Collection[str],
    offered: Iterable[str],
    notes: Mapping[str, str],
) -> str:
    """Return `key` with the key offered for it, or else the keys offered that share a
    word with it, as `_could_mean` allows (`cpu_size`: the CPU tier's byte sizes); and
    the `notes` on the keys offered."""
    if offer:
        return f"{key} ({_noted(f'did you mean {offer!r}?', [offer], notes)})"
    lower, words = key.lower(), _words(key)
    if "gpu" in words:
        return f"{key} (kvtier sizes its CPU and disk tiers; the GPU's KV cache is the engine's)"
    like = [n for n in offered if n not in given and _could_mean(lower, n) and words & _words(n)]
    return f"{key} ({_noted('keys like it: ' + ', '.join(like), like, notes)})" if like else key


def _noted(text: str, keys: Iterable[str], notes: Mapping[str, str]) -> str:
    """Return `text` followed by the notes on `keys`, each once."""
    said = list(dict.fromkeys(notes[key] for key in keys if key in notes))
    return " ".join([text, *said]) if text.endswith("?") else "; ".join([text, *said])


def _closest(key: str, valid: Collection[str]) -> str | None:
    """Return the valid key closest to the misspelt `key` among those it could mean
    (see `_could_mean`), or None when none is close."""
    by_lower = {name.lower(): name for name in valid}  # `CPU_BYTES`: cpu_bytes
    fits = sorted(n for n in by_lower if _could_mean(key.lower(), n))
    close = difflib.get_close_matches(key.lower(), fits, n=1)
    return by_lower[close[0]] if close else None


def _offer(
    key: str,
    meant: str | None,
    given: Collection[str],
    offered: Collection[str],
    instead: Mapping[str, str],
) -> str | None:
    """Return the key to offer for the misspelt `key`, whose closest valid key is `meant`
    and not given (see `check_known_keys`; `instead` names valid keys only), or None."""
    if meant is None:
        return None
    if meant in offered:
        return meant
    other = instead.get(meant)
    if other is None or other in given:
        return None
    return other if difflib.get_close_matches(key.lower(), [other.lower()], n=1) else None


# host memory: the CPU tier; the GPU's KV cache is the engine's (vLLM's), no key of kvtier's
_TIER_WORDS = {"cpu": "cpu", "host": "cpu", "disk": "disk", "gpu": "gpu"}
_SIZE_WORDS = {"bytes", "size", "capacity", "memory", "mem"}


def _words(key: str) -> set[str]:
    """Return the words of `key`, a tier's and a size's by one name each."""
    words = set(key.lower().split("_")) - {"", "to", "use", "per"}
    return {"bytes" if w in _SIZE_WORDS else _TIER_WORDS.get(w, w) for w in words}


def _could_mean(key: str, name: str) -> bool:
    """Return False when the valid key `name` cannot be what the misspelt `key` meant:
    `key` names the GPU (no key of kvtier's sizes it), `name` names the other tier, or
    `key` names a size and `name` is not a byte size."""
    words, name_words = set(key.split("_")), set(name.split("_"))
    tiers = {_TIER_WORDS[w] for w in words if w in _TIER_WORDS}
    name_tiers = {_TIER_WORDS[w] for w in name_words if w in _TIER_WORDS}
    if "gpu" in tiers or (tiers and name_tiers and tiers != name_tiers):
        return False
    return not (words & _SIZE_WORDS) or "bytes" in name_words


FIELD_TYPES: dict[str, type] = {
    "cpu_bytes": int,
    "disk_bytes": int,
    "disk_path": str,
    "disk_io_mode": DiskIOMode,
    "disk_buffer_slots": int,
    "num_blocks": int,
    "store_mode": StoreMode,
    "hash_algo": HashAlgo,
    "hash_seed": str,
    "events": bool,
    "max_batched_tokens": int,
    "fine_grained_hits": bool,
    "eviction_policy": str,
    "admission_policy": str,
    "cascade": CascadeMode,
    "disk_persist": bool,
    "token_check": bool,
}
_OPTIONAL = {"disk_path", "num_blocks", "hash_seed"}
# The keys `OffloadConfig.from_dict` accepts: the fields and the SPEC's `disk_direct_io`.
CONFIG_KEYS = frozenset({*FIELD_TYPES, "disk_direct_io"})


def check_type(name: str, value: object) -> None:
    """Raise ConfigError naming `name` when `value` is not of the field's type."""
    kind = FIELD_TYPES[name]
    if value is None and name in _OPTIONAL:
        return
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {_type_name(kind)}, got {value!r}")


# The most staging buffers per direction: each holds 4 MiB (disk_tier.DiskTierConfig
# .batch_bytes) or one block if larger, so 64 is 512 MiB of host memory for the two
# directions with blocks up to 4 MiB.
MAX_DISK_BUFFER_SLOTS = 64
# The least value of each int field that has one (num_blocks: the null block and one more).
_MINIMUMS = {
    "cpu_bytes": 0,
    "disk_bytes": 0,
    "disk_buffer_slots": 1,
    "num_blocks": 2,
    "max_batched_tokens": 1,
}
_REGISTRIES: dict[str, Mapping[str, object]] = {
    "eviction_policy": EVICTION_POLICIES,
    "admission_policy": ADMISSION_POLICIES,
}


def valid_value(name: str, value: object) -> object:
    """Return `value` normalized for field `name`; raise ConfigError naming a bad one.

    Policy names ignore case and surrounding spaces, as `PolicySpec.parse` does, and so
    do the names of enum fields' members (`cascade="write_back"`); a `disk_path` (a str
    or a path object) is made an absolute str, and numpy ints are taken as ints.
    """
    value = _as_python(name, as_enum(name, value))
    check_type(name, value)
    if name == "disk_path" and isinstance(value, str):
        rule = "it is empty; give the directory of the disk tier's files, or leave it out"
        _require(value.strip() != "", name, value, rule)
        _require("\x00" not in value, name, value, "a path cannot hold a NUL character")
        return os.path.abspath(os.path.expanduser(value))
    if isinstance(value, int) and name in _MINIMUMS:
        _require(value >= _MINIMUMS[name], name, value, f"must be >= {_MINIMUMS[name]}")
    if name == "disk_buffer_slots" and isinstance(value, int):
        rule = (
            f"must be <= {MAX_DISK_BUFFER_SLOTS} (each is a staging buffer of 4 MiB, or one "
            "block if larger, per I/O direction)"
        )
        _require(value <= MAX_DISK_BUFFER_SLOTS, name, value, rule)
    if name == "hash_seed":
        rule = (
            "must not be empty (leave it unset for the default: sha256's fixed public seed, "
            "or with xxhash a random seed per process)"
        )
        _require(value != "", name, value, rule)
    registry = _REGISTRIES.get(name)
    if registry is not None and isinstance(value, str):
        ok = value.strip().lower() in registry
        _require(ok, name, value, f"choose one of {', '.join(registry)}{_split_hint(value)}")
        return value.strip().lower()
    return value


def _as_python(name: str, value: object) -> object:
    """Return a path object (`pathlib.Path`) for `disk_path` as its str, and an integral
    number that is not a bool (numpy's ints) for an int field as an int; `value` else."""
    if name == "disk_path" and isinstance(value, os.PathLike):
        return os.fspath(value)  # a bytes path stays bytes: refused as not a str
    is_int_field = FIELD_TYPES[name] is int and not isinstance(value, bool)
    if is_int_field and isinstance(value, numbers.Integral):  # numpy's bool_ is not one
        return int(value)
    return value


def _split_hint(value: str) -> str:
    """Say how to give a combined `EVICTION+ADMISSION` name given as one policy key."""
    if "+" not in value:
        return ""
    eviction, _, admission = value.partition("+")
    return (
        f"; {value!r} names an eviction and an admission policy: give them as "
        f"eviction_policy={eviction.strip()!r} and admission_policy={admission.strip()!r}"
    )


def as_enum(name: str, value: object) -> object:
    """Return the member a string names for an enum field (any case, surrounding spaces
    ignored); raise ConfigError listing the choices for a name that is none of them."""
    enum_type = _ENUM_FIELDS.get(name)
    if enum_type is None or not isinstance(value, str):
        return value
    try:
        return enum_type(value.strip().lower())
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}") from None


_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "disk_io_mode": DiskIOMode,
    "store_mode": StoreMode,
    "hash_algo": HashAlgo,
    "cascade": CascadeMode,
}


def _type_name(kind: type) -> str:
    if issubclass(kind, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in kind)
    return f"an {kind.__name__}" if kind.__name__[0] in "aeiou" else f"a {kind.__name__}"


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")
