"""Run a `kvtier` command whose stdout reader has gone, for the closed-pipe tests."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def run_into_closed_pipe(command: Sequence[str]) -> tuple[int, str]:
    """Run `command` with its stdout's read end closed before it writes (every write
    meets EPIPE); return its exit status and its stderr."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        status = proc.wait(timeout=120)
    return status, stderr
