"""One progress bar over work spread across worker processes (the replay benchmarks).

`run_with_progress(jobs, calls, unit)` runs each `fn(*args, progress)` in a process pool.
A worker says how much work it has (`progress.add_total(n)`) and how much it did
(`progress.advance(n)`, fit to be a replay's progress callback); the parent adds both up
in one tqdm bar on stderr, drawn on a terminal only, as `kvtier replay`'s bar is.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Any, TypeVar

from tqdm import tqdm

from kvtier.replay.stdout_lines import progress_bar_disable

T = TypeVar("T")
POLL_S = 0.2


class Progress:
    """A worker's end of the bar (picklable): sends `(total, done)` increments."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def add_total(self, n: int) -> None:
        """Say that `n` more units of work are coming."""
        self._sink.put((n, 0))

    def advance(self, n: int) -> None:
        """Say that `n` units of work are done."""
        self._sink.put((0, n))


def run_with_progress(
    jobs: int, calls: Sequence[tuple[Callable[..., T], tuple[Any, ...]]], unit: str
) -> list[T]:
    """Return `[fn(*args, progress) for fn, args in calls]`, run in `jobs` processes."""
    with multiprocessing.Manager() as manager, ProcessPoolExecutor(max_workers=jobs) as pool:
        sink = manager.Queue()
        progress = Progress(sink)
        futures = [pool.submit(fn, *args, progress) for fn, args in calls]
        with tqdm(total=0, unit=unit, leave=False, disable=progress_bar_disable()) as bar:
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=POLL_S)
                _drain(sink, bar)
        return [future.result() for future in futures]


def _drain(sink: Any, bar: tqdm) -> None:
    """Add every increment waiting in `sink` to `bar`."""
    total = done = 0
    while True:
        try:
            more_total, more_done = sink.get_nowait()
        except queue.Empty:
            break
        total += more_total
        done += more_done
    if total:
        bar.total += total
        bar.refresh()
    if done:
        bar.update(done)
