"""What `kvtier demo` shows on a terminal while it runs."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.progress import Progress
from test_demo_cli_errors import SMALL_RUN, run_demo
from test_demo_disk_space import FullDiskLLM

from kvtier.cli import demo


def terminal_screen(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """Give the demo's progress a terminal console; return what it writes there."""
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(demo, "progress_console", lambda: terminal)
    return screen


def test_a_terminal_is_told_what_runs_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: nothing was shown until the first configuration was served: the
    # model's load and the warm-up (seconds for the demo model, longer for a
    # checkpoint) left a blank terminal.
    screen = terminal_screen(monkeypatch)
    assert run_demo(tmp_path, "--disk-io=page_cache") == 0
    text = screen.getvalue()
    positions = [text.find(line) for line in ("loading the model", "warming up", "serving")]
    assert -1 not in positions, text
    assert positions == sorted(positions)


def test_a_run_that_cannot_start_is_reported_on_stderr_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: printed while the progress bar showed, the error went through rich's
    # redirect onto the bar's console: on stdout then (`kvtier demo 2>err.log` left
    # err.log empty), and drawn as part of the display.
    screen = terminal_screen(monkeypatch)
    monkeypatch.setattr(demo, "LLM", FullDiskLLM)
    assert run_demo(tmp_path, "--disk-io=page_cache") == 1
    message = "kvtier demo: error: the disk tier run cannot start: [Errno 28] cannot size"
    assert capsys.readouterr().err.startswith(message)
    assert "cannot start" not in screen.getvalue()
    assert list(tmp_path.glob("kvtier-demo-*")) == []


def read_all(fd: int) -> bytes:
    """Read a pty's master side until its slave side is closed everywhere."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the demo exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def run_with_terminal_stderr(tmp_path: Path, *options: str) -> tuple[int, str, str]:
    """Run the small demo with stdout a pipe and stderr a pty; return its exit status,
    what the pty showed (terminal codes dropped, one line per line or redraw) and stdout."""
    command = [sys.executable, "-m", "kvtier", "demo", *SMALL_RUN, "--disk-io=page_cache"]
    command += [f"--disk-dir={tmp_path}", f"--out={tmp_path / 'out'}", *options]
    master, slave = pty.openpty()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave) as proc:
        os.close(slave)
        terminal = read_all(master).decode()
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        status = proc.wait(timeout=120)
    os.close(master)
    terminal = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal).replace("\r", "\n")
    return status, terminal, out


def test_the_progress_shows_on_a_terminal_stderr_when_stdout_is_a_pipe(tmp_path: Path) -> None:
    # Regression: the progress went to stdout's console, so `make demo | tee log` or
    # `kvtier demo > out.txt` showed nothing for minutes; it goes to stderr now.
    status, terminal, out = run_with_terminal_stderr(tmp_path)
    assert status == 0, terminal
    for line in ("loading the model", "warming up", "serving: CPU+disk"):
        assert line in terminal
    assert "identical tokens across configurations: yes" in out
    assert "serving" not in out
    assert "\x1b" not in out  # no terminal codes in the results


def test_verbose_log_lines_start_their_own_line_under_the_progress_bar(tmp_path: Path) -> None:
    # Regression: `kvtier demo -v` wrote its INFO lines across the progress bar's
    # ("25% 0:00:04INFO kvtier.transfer.worker: ..."): the handler held the stderr the
    # live display had replaced.
    status, terminal, _ = run_with_terminal_stderr(tmp_path, "-v")
    assert status == 0, terminal
    assert "INFO kvtier.transfer.worker: offload worker" in terminal
    for line in terminal.splitlines():
        assert "INFO" not in line or line.startswith("INFO"), line


def test_the_progress_bar_counts_every_turn_of_every_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a mutation run (s29): a bar whose total was one configuration's turns
    (full after the first run, then past 100%) passed every test."""
    seen: list[tuple[float | None, float]] = []

    class RecordingProgress(Progress):
        def __exit__(self, *args: Any) -> None:
            seen.extend((task.total, task.completed) for task in self.tasks)
            super().__exit__(*args)

    monkeypatch.setattr(demo, "Progress", RecordingProgress)
    options = ["--conversations=2", "--turns=3", "--disk-io=page_cache"]
    assert run_demo(tmp_path, *options) == 0
    assert seen == [(4 * 3, 4 * 3)]  # 4 configurations of 3 turns each
