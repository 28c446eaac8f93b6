"""`kvtier demo`'s plot is written whole: a save that fails part-way (a full disk, Ctrl-C)
left a truncated demo_ttft.png in place of the previous one."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from kvtier.cli.demo_plot import PLOT_NAME, save_ttft_plot, ttft_figure, write_ttft_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def ttft_ms_by_turn() -> dict[str, dict[int, float]]:
    return {"offload off": {0: 30.0, 1: 45.0, 2: 60.0}, "CPU tier": {0: 30.0, 1: 12.0, 2: 14.0}}


def test_the_plot_is_a_png_with_a_line_per_configuration(tmp_path: Path) -> None:
    path = tmp_path / PLOT_NAME
    write_ttft_plot(path, ttft_ms_by_turn())
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert os.listdir(tmp_path) == [PLOT_NAME]
    assert plt.get_fignums() == []
    fig = ttft_figure(ttft_ms_by_turn())
    try:
        lines = fig.axes[0].get_lines()
        assert [line.get_label() for line in lines] == ["offload off", "CPU tier"]
        assert list(lines[1].get_ydata()) == [30.0, 12.0, 14.0]
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()]
)
@pytest.mark.parametrize("previous", [b"the previous plot", None])
def test_a_save_that_fails_part_way_leaves_the_previous_plot_and_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, previous: bytes | None
) -> None:
    path = tmp_path / PLOT_NAME
    if previous is not None:
        path.write_bytes(previous)
    save = Figure.savefig

    def save_half_then_fail(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        save(self, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if hasattr(fname, "write"):
            fname.write(half)
            fname.flush()
        else:
            Path(fname).write_bytes(half)
        raise error

    monkeypatch.setattr(Figure, "savefig", save_half_then_fail)
    with pytest.raises(type(error)):
        write_ttft_plot(path, ttft_ms_by_turn())
    if previous is None:
        assert os.listdir(tmp_path) == []
    else:
        assert os.listdir(tmp_path) == [PLOT_NAME]
        assert path.read_bytes() == previous
    assert plt.get_fignums() == []


def test_save_ttft_plot_creates_the_folder_and_returns_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "plots"
    assert save_ttft_plot(out, ttft_ms_by_turn()) == out / PLOT_NAME
    assert (out / PLOT_NAME).read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().err == ""


def test_a_plot_that_cannot_be_written_is_one_line_naming_the_path_and_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a full disk ended the demo, after every run, in an OSError traceback.
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    out = tmp_path / "out"
    assert save_ttft_plot(out, ttft_ms_by_turn()) is None
    assert capsys.readouterr().err == (
        f"kvtier demo: error: cannot write the plot {out / PLOT_NAME}: No space left on device\n"
    )


def test_a_plot_folder_that_cannot_be_created_is_one_line_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")  # made after the demo checked --out, say
    out = tmp_path / "afile" / "out"
    assert save_ttft_plot(out, ttft_ms_by_turn()) is None
    assert capsys.readouterr().err == (
        f"kvtier demo: error: cannot write the plot {out / PLOT_NAME}: Not a directory\n"
    )


def test_each_line_runs_by_turn_with_a_tick_per_turn_and_a_legend() -> None:
    """Found by a mutation run (s29): points joined in the mapping's order instead of by
    turn, no tick per turn (matplotlib's own ticks fall between turns: 0.5, 1.5) and no
    legend (which line is which configuration) all passed every test."""
    fig = ttft_figure({"offload off": {2: 60.0, 0: 30.0, 1: 45.0}, "CPU tier": {0: 30.0, 1: 12.0}})
    try:
        (ax,) = fig.axes
        first = ax.get_lines()[0]
        assert (list(first.get_xdata()), list(first.get_ydata())) == ([0, 1, 2], [30.0, 45.0, 60.0])
        assert list(ax.get_xticks()) == [0, 1, 2]
        legend = ax.get_legend()
        assert legend is not None
        assert [text.get_text() for text in legend.get_texts()] == ["offload off", "CPU tier"]
    finally:
        plt.close(fig)


def test_the_axes_say_turn_and_milliseconds() -> None:
    """The y values are the mean TTFT in ms (`_mean_ttft_ms_by_turn`). Found by a mutation
    run (s32): a y axis labelled in seconds passed every test."""
    fig = ttft_figure(ttft_ms_by_turn())
    try:
        (ax,) = fig.axes
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("turn", "mean TTFT (ms)")
    finally:
        plt.close(fig)


def test_the_plot_is_drawn_without_a_display() -> None:
    """Found by a mutation run (s29): not selecting Agg passed every test, which run where
    Agg is the default anyway; on a desktop pyplot's default backend opens windows."""
    previous = matplotlib.get_backend()
    plt.switch_backend("svg")  # a backend other than Agg, as a desktop's would be
    try:
        plt.close(ttft_figure(ttft_ms_by_turn()))
        assert matplotlib.get_backend().lower() == "agg"
    finally:
        plt.switch_backend(previous)
