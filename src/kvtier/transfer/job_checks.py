"""Type and range checks of a transfer job's fields, before the worker starts anything.

A job breaking the contract is a scheduler (or adapter) bug: it raises ValueError naming
the event, the field and the bad value, instead of being coerced (`1.7` read as block 1,
`True` as block 1) or failing deep inside numpy or torch. Block ids may be Python ints,
numpy integers, or a 1-D numpy integer array; the common case, a tuple of Python ints,
costs one C-level pass over the types on top of the conversion to an array.
"""

from __future__ import annotations

import numpy as np

from kvtier.offload.plan import Tier, TransferJob, TransferPlan

_EXACT_INT = frozenset({int})
_MAX_SHOWN = 8  # bad ids quoted in a message


def check_plan_fields(plan: TransferPlan) -> None:
    """Raise ValueError naming the field and value unless the plan's flags are bools and
    its `forget_slots` a tuple (a pickled plan skips any check; the slot ids themselves
    are the disk tier's to check)."""
    for name in ("need_flush", "end_persistence"):
        value = getattr(plan, name)
        if not isinstance(value, bool):
            raise ValueError(f"TransferPlan.{name} must be a bool, got {value!r}")
    if not isinstance(plan.forget_slots, tuple | list):
        raise ValueError(
            f"TransferPlan.forget_slots must be a tuple of slot ids, got {plan.forget_slots!r}"
        )


def check_job_fields(job: TransferJob) -> None:
    """Raise ValueError unless the job's event id is an int and its tiers are Tiers."""
    if not _is_int(job.event_id):
        raise ValueError(f"TransferJob.event_id must be an int, got {job.event_id!r}")
    for name, tier in (("src_tier", job.src_tier), ("dst_tier", job.dst_tier)):
        if not isinstance(tier, Tier):
            raise ValueError(f"event {job.event_id}: {name} must be a Tier, got {tier!r}")


def block_id_array(event_id: int, label: str, ids: object, num_ids: int) -> np.ndarray:
    """Return `ids` as an int64 array once every id is an int in `[0, num_ids)`.

    Raises ValueError naming `event_id`, `label` (e.g. "GPU ids") and the bad ids.
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"event {event_id}: {label} must be a 1-D integer array, got {ids.dtype} "
                f"of shape {ids.shape}"
            )
        _check_range(event_id, label, ids, num_ids)
        return ids.astype(np.int64)  # a copy: the caller may reuse its array at once
    if not isinstance(ids, tuple | list):
        raise ValueError(
            f"event {event_id}: {label} must be a tuple of ints, got {type(ids).__name__}"
        )
    if not _EXACT_INT.issuperset(map(type, ids)):
        ids = [_checked_int(event_id, label, value) for value in ids]
    try:
        array = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # beyond int64: out of range whatever the tier size
        bad = [value for value in ids if not 0 <= value < num_ids]
        raise ValueError(_outside(event_id, label, bad, num_ids)) from None
    _check_range(event_id, label, array, num_ids)
    return array


def check_counts(event_id: int, num_src: int, num_dst: int, records: object) -> None:
    """Raise ValueError naming the counts unless every source block has a destination
    and `records` is empty or holds one record per destination."""
    if num_src != num_dst:
        raise ValueError(
            f"event {event_id}: {num_src} source blocks but {num_dst} destination blocks"
        )
    if not isinstance(records, tuple | list):
        raise ValueError(
            f"event {event_id}: dst_records must be a tuple, got {type(records).__name__}"
        )
    if records and len(records) != num_dst:
        raise ValueError(
            f"event {event_id}: {len(records)} slot records for {num_dst} destination blocks"
        )


def check_distinct(event_id: int, label: str, ids: np.ndarray) -> None:
    """Raise ValueError naming the repeated ids unless every id of `ids` is distinct."""
    ordered = np.sort(ids)  # sorting beats np.unique's hashing several times over
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        raise ValueError(
            f"event {event_id}: repeated {label} {np.unique(repeated)[:_MAX_SHOWN].tolist()}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _checked_int(event_id: int, label: str, value: object) -> int:
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    raise ValueError(
        f"event {event_id}: {label} hold {value!r} ({type(value).__name__}), not an int block id"
    )


def _check_range(event_id: int, label: str, ids: np.ndarray, num_ids: int) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= num_ids):
        bad = ids[(ids < 0) | (ids >= num_ids)].tolist()
        raise ValueError(_outside(event_id, label, bad, num_ids))


def _outside(event_id: int, label: str, bad: list[int], num_ids: int) -> str:
    return f"event {event_id}: {label} {bad[:_MAX_SHOWN]} outside [0, {num_ids})"
