"""Checks of where `kvtier replay` writes, at edges the first mutation run on outputs.py
found untested: a descriptor open for reading only, a hard link to the trace, and an
existing `--out` folder whose `sweep.csv` cannot be a file; and paths longer than the
system takes."""

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


def test_a_path_longer_than_the_system_takes_is_refused_naming_its_length(
    tmp_path: Path,
) -> None:
    """Every name short, the whole path past PATH_MAX (4096 bytes on Linux with the null
    byte): refused before the run, by its length, for a file and for a folder."""
    text = str(tmp_path) + "/d" * 2100 + "/r.json"
    size = len(text.encode())
    limit = os.pathconf(tmp_path, "PC_PATH_MAX") - 1
    message = f"the path is {size} bytes long, more than the {limit} a path can have here"
    with pytest.raises(ReplayError, match=f"^--json .*: {message}$"):
        check_file_path("--json", text)
    with pytest.raises(ReplayError, match=f"^--out .*: {message}$"):
        check_folder_path("--out", text, ["sweep.csv"])


def test_a_name_at_the_limit_passes_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    """NAME_MAX (255 bytes on Linux) is the longest name a file can have; the name's
    bytes count, not its characters (`é` is two)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    check_file_path("--json", str(tmp_path / ("n" * limit)))
    with pytest.raises(ReplayError, match=f"is {limit + 1} bytes long, more than the {limit}"):
        check_file_path("--json", str(tmp_path / ("é" + "n" * (limit - 1))))
