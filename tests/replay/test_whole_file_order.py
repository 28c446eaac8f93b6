"""`whole_file`'s error naming and output order, found by the first mutation run on
whole_file.py: an OSError with no file name (a full disk) on a regular file, and the
flush that keeps a command's printed lines before what it writes to /dev/stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay.whole_file import whole_file


def test_a_full_disk_on_a_regular_file_is_named_with_the_path(tmp_path: Path) -> None:
    """An OSError that names no file (ENOSPC from a write) gets the path asked for, and
    the old content stays."""
    path = tmp_path / "r.json"
    path.write_text("old\n")

    def fill_the_disk() -> None:
        with whole_file(path) as file:
            file.write("new")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left") as raised:
        fill_the_disk()
    assert raised.value.filename == str(path)
    assert path.read_text() == "old\n"


def test_lines_printed_before_a_write_to_stdout_come_first() -> None:
    """Through a pipe stdout is block-buffered (unless PYTHONUNBUFFERED is set, as it is
    taken out here): what the command printed is flushed before the file written through
    descriptor 1, not after it."""
    program = (
        "from kvtier.replay.whole_file import whole_file\n"
        "print('printed first')\n"
        "with whole_file('/dev/stdout') as file:\n"
        "    file.write('written second\\n')\n"
    )
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=buffered
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "printed first\nwritten second\n"
