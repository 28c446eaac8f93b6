"""`kvtier demo`'s plot: mean TTFT per turn, one line per configuration (PNG).

Kept apart from the demo so that it imports neither torch nor the engine.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.replay.whole_file import whole_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_NAME = "demo_ttft.png"


def save_ttft_plot(out: Path, ttft_ms_by_turn: Mapping[str, Mapping[int, float]]) -> Path | None:
    """Write the plot into the folder `out` (created if missing); return its path.

    A plot that cannot be written (a full disk, a folder removed since the demo checked
    it) is one line on stderr naming the path and the reason, and returns None: the
    runs are done and their results printed, so it is no traceback.
    """
    path = out / PLOT_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_ttft_plot(path, ttft_ms_by_turn)
    except OSError as exc:
        reason = exc.strerror or exc
        print(f"kvtier demo: error: cannot write the plot {path}: {reason}", file=sys.stderr)
        return None
    return path


def write_ttft_plot(path: Path, ttft_ms_by_turn: Mapping[str, Mapping[int, float]]) -> None:
    """Write the plot of {configuration: {turn: mean TTFT in ms}} to `path` as a PNG.

    The file is written whole or not at all: a failure part-way (a full disk, Ctrl-C)
    leaves `path` as it was and no partial file beside it.
    """
    fig = ttft_figure(ttft_ms_by_turn)
    import matplotlib.pyplot as plt

    try:
        with whole_file(path, binary=True) as file:
            fig.savefig(file, format="png", dpi=120)
    finally:
        plt.close(fig)


def ttft_figure(ttft_ms_by_turn: Mapping[str, Mapping[int, float]]) -> Figure:
    """Return the plot's figure; the caller closes it (`plt.close`). Selects Agg (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    turns: set[int] = set()
    for name, by_turn in ttft_ms_by_turn.items():
        xs = sorted(by_turn)
        ax.plot(xs, [by_turn[x] for x in xs], marker="o", label=name)
        turns.update(xs)
    ax.set_xticks(sorted(turns))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("kvtier demo: time to first token per turn")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
