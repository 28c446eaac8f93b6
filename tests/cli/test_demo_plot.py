"""`kvtier demo`'s plot is written whole: a save that fails part-way (a full disk, Ctrl-C)
left a truncated demo_ttft.png in place of the previous one."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from kvtier.cli.demo_plot import PLOT_NAME, ttft_figure, write_ttft_plot

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
