"""`whole_file`'s error naming, output order and temporary files, found by the first
mutation run on whole_file.py: an OSError with no file name (a full disk) on a regular
file or from a rename, the flush that keeps a command's printed lines before what it
writes to /dev/stdout, the hidden temporary file, and which paths are written in place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay.whole_file import descriptor_of, file_set, whole_file, written_in_place


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


def test_the_temporary_file_is_hidden_beside_the_target(tmp_path: Path) -> None:
    """While a file is written, the folder shows only a hidden `.NAME.*.part` file (a
    shell glob `*.json` never picks up a half-written one)."""
    with whole_file(tmp_path / "r.json") as file:
        file.write("{}")
        (temp,) = os.listdir(tmp_path)
    assert temp.startswith(".r.json.")
    assert temp.endswith(".part")
    assert os.listdir(tmp_path) == ["r.json"]


def test_a_failed_rename_names_the_target(tmp_path: Path) -> None:
    """A set's rename that fails (the target became a non-empty folder meanwhile) names
    the file asked for, not the hidden temporary one."""
    target = tmp_path / "r.json"
    with pytest.raises(OSError) as raised, file_set():  # noqa: PT012 - the set ends last
        with whole_file(target) as file:
            file.write("{}")
        target.mkdir()
        (target / "inside").write_text("x")
    assert raised.value.filename == str(target)
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # the temporary file is removed


def test_only_devices_pipes_and_descriptors_are_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("x")
    assert written_in_place(fifo)
    assert written_in_place("/dev/null")
    assert written_in_place("/dev/stdout")
    assert not written_in_place(tmp_path / "file")
    assert not written_in_place(tmp_path / "new")


def test_a_descriptor_path_is_the_whole_name(tmp_path: Path) -> None:
    """`/dev/fd/3.json` is no descriptor (a file of that name would be replaced)."""
    assert descriptor_of("/dev/fd/3.json") is None
    assert descriptor_of("/proc/self/fd/1x") is None
