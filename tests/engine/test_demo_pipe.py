"""`kvtier demo` into a pipe whose reader has gone (`kvtier demo | head -2`)."""

from __future__ import annotations

import sys
from pathlib import Path

from test_demo_cli_errors import SMALL_RUN

from closed_pipe import run_into_closed_pipe
from kvtier.cli.main import BROKEN_PIPE_STATUS


def test_a_closed_pipe_ends_the_demo_with_the_broken_pipe_status(tmp_path: Path) -> None:
    # Regression: rich's handler for the closed pipe raised SystemExit(1), so the demo
    # exited 1 (a failed run) where kvtier's other commands exit 141, as the shell
    # reports a process killed by SIGPIPE. The read end is closed before the demo writes.
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    command = [sys.executable, "-m", "kvtier", "demo", *SMALL_RUN, "--disk-io=page_cache"]
    command += [f"--disk-dir={disk_dir}", f"--out={tmp_path / 'out'}"]
    status, stderr = run_into_closed_pipe(command)
    assert status == BROKEN_PIPE_STATUS, stderr
    assert stderr == ""
    assert list(disk_dir.iterdir()) == []  # the disk tier's folder was removed
