"""The disk tier's I/O plumbing: one-thread pools that record their thread (a close
called from one of them must not wait for itself), the check of a batch's slot
ids, and the runs of consecutive slot ids a batch becomes (one read or write each)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def io_pool(side: str, threads: set[threading.Thread]) -> ThreadPoolExecutor:
    """Return a one-thread pool whose thread adds itself to `threads` as it starts.

    The thread object, not its ident: an ident is reused by a thread started after this
    one exited, which would then be taken for an I/O thread."""
    return ThreadPoolExecutor(
        1,
        thread_name_prefix=f"kvtier-disk-{side}",
        initializer=_record_thread,
        initargs=(threads,),
    )


def _record_thread(threads: set[threading.Thread]) -> None:
    threads.add(threading.current_thread())


def check_slot_ids(slot_ids: object, num_slots: int) -> None:
    """Raise ValueError naming `slot_ids` unless it is a 1-D integer array of ids in
    `[0, num_slots)` (floats would be truncated, a bool array taken as a mask)."""
    if (
        not isinstance(slot_ids, np.ndarray)
        or slot_ids.ndim != 1
        or slot_ids.dtype.kind not in "iu"
    ):
        what = (
            f"{slot_ids.dtype} array of shape {slot_ids.shape}"
            if isinstance(slot_ids, np.ndarray)
            else type(slot_ids).__name__
        )
        raise ValueError(f"slot ids must be a 1-D integer array, got a {what}: {slot_ids!r}")
    if len(slot_ids) and (slot_ids.min() < 0 or slot_ids.max() >= num_slots):
        raise ValueError(f"slot ids outside [0, {num_slots}): {slot_ids.tolist()}")


def slot_id_list(slots: Sequence[object], num_slots: int) -> list[int]:
    """Return `slots` as ints; raise ValueError naming those that are not integers
    (`int()` would truncate a float or parse a string) or outside `[0, num_slots)`."""
    ids: list[int] = []
    odd: list[object] = []
    for slot in slots:
        if isinstance(slot, (int, np.integer)) and not isinstance(slot, bool):
            ids.append(int(slot))
        else:
            odd.append(slot)
    if odd:
        raise ValueError(f"slot ids must be integers, got {odd}")
    bad = [slot for slot in ids if not 0 <= slot < num_slots]
    if bad:
        raise ValueError(f"slot ids outside [0, {num_slots}): {bad}")
    return ids


def consecutive_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Return `[a, b)` index ranges over which `ids` goes up by exactly one."""
    if len(ids) == 0:
        return []
    cuts = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist(), len(ids)]
    return list(itertools.pairwise(cuts))
