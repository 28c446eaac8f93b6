"""Bound the OpenMP team that torch CPU ops use when called from a transfer thread."""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)


def limit_intra_op_threads(num_threads: int) -> bool:
    """Make torch CPU ops called from the current thread use at most `num_threads` threads.

    torch splits a CPU kernel across an OpenMP team of `torch.get_num_threads()` threads.
    A team per background transfer thread competes with the engine for every core, and
    on a busy machine each parallel region waits for its slowest member (measured: 4 MiB
    copies stalling for milliseconds, starving the disk I/O thread). `torch.set_num_threads`
    would change the whole process; this sets only the calling thread's OpenMP setting
    (other threads, the engine's included, keep theirs). Returns False, changing nothing,
    when the OpenMP runtime is not reachable (e.g. a torch build without OpenMP).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be positive, got {num_threads}")
    torch.get_num_threads()  # let torch initialise this thread's setting before overriding it
    try:
        set_num_threads = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError, TypeError):
        logger.debug("OpenMP runtime not found; transfer threads keep torch's thread count")
        return False
    set_num_threads(num_threads)
    return torch.get_num_threads() == num_threads
