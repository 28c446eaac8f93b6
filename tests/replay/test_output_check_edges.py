"""Checks of where `kvtier replay` writes, at edges the first mutation run on outputs.py
found untested: a descriptor open for reading only, a hard link to the trace, and an
existing `--out` folder whose `sweep.csv` cannot be a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.replay.config import ReplayError
from kvtier.replay.outputs import check_distinct_paths, check_file_path, check_folder_path


def test_a_descriptor_open_for_reading_only_is_refused(tmp_path: Path) -> None:
    """`--json /dev/fd/N` with N opened read-only (`N<file`) cannot take the results."""
    source = tmp_path / "in.txt"
    source.write_text("x")
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(ReplayError, match=f"descriptor {fd} is open for reading only"):
            check_file_path("--json", f"/dev/fd/{fd}")
    finally:
        os.close(fd)


def test_a_hard_link_to_the_trace_is_the_trace(tmp_path: Path) -> None:
    """Another name of the same file (a hard link) would overwrite the trace too."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    link = tmp_path / "r.json"
    os.link(trace, link)
    with pytest.raises(ReplayError, match=f"--json {link}: would overwrite the trace {trace}"):
        check_distinct_paths(str(trace), [("--json", str(link))])


def test_an_existing_out_folder_is_checked_for_each_file_it_gets(tmp_path: Path) -> None:
    """`--out d` where `d/sweep.csv` is a folder: refused before the run, not after."""
    (tmp_path / "sweep.csv").mkdir()
    with pytest.raises(ReplayError, match=r"sweep\.csv: is a directory, give a file name"):
        check_folder_path("--out", str(tmp_path), ["sweep.csv", "sweep.png"])
