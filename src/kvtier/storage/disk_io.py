"""The disk tier's I/O plumbing: one-thread pools that record their thread's ident (a
close called from one of them must not wait for itself), and the runs of consecutive
slot ids a batch becomes (one read or write each)."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def io_pool(side: str, idents: set[int]) -> ThreadPoolExecutor:
    """Return a one-thread pool whose thread adds its ident to `idents` as it starts."""
    return ThreadPoolExecutor(
        1,
        thread_name_prefix=f"kvtier-disk-{side}",
        initializer=_record_thread,
        initargs=(idents,),
    )


def _record_thread(idents: set[int]) -> None:
    idents.add(threading.get_ident())


def consecutive_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Return `[a, b)` index ranges over which `ids` goes up by exactly one."""
    if len(ids) == 0:
        return []
    cuts = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist(), len(ids)]
    return list(itertools.pairwise(cuts))
