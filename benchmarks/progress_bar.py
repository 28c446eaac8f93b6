"""`progress_bar`: the in-process benchmarks' progress bar, as `kvtier replay`'s is.

A tqdm bar on stderr, drawn on a terminal only (piped or redirected, the benchmark prints
exactly what it printed without one), and cleared when it closes (`leave=False`), so the
lines a benchmark prints after it read as before. A benchmark updates it between its timed
sections, never inside a timer.
"""

from __future__ import annotations

from tqdm import tqdm

from kvtier.replay.stdout_lines import progress_bar_disable


class TerminalBar(tqdm):
    """tqdm without its monitor thread: a second thread in the process changed what
    bench_pool measures (the resident memory of a 10M-block pool: 173.4 bytes per block
    with the thread, 169.6 without, on a terminal). `progress_bar` checks the time at
    every update instead (`miniters=1`), so the bar never waits for the monitor."""

    monitor_interval = 0


def progress_bar(total: int | None, unit: str, desc: str | None = None) -> tqdm:
    """Return a bar over `total` units of work (None: a count with no end)."""
    return TerminalBar(
        total=total,
        unit=unit,
        desc=desc,
        leave=False,
        miniters=1,
        disable=progress_bar_disable(),
    )
