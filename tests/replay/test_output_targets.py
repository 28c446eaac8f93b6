"""Where `kvtier replay` writes: descriptors (`--json /dev/stdout`) and odd file names.

Regressions: `/dev/fd/N` was resolved to its target first, so a pipe became a path in
/proc that cannot hold a temporary file (the JSON was lost after the whole replay), and a
redirected stdout was replaced by a new file (what was printed before and after it was
lost); a `$` pair in the trace's name was parsed as math by the sweep plot's title.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.replay import outputs
from kvtier.replay.cli import main
from kvtier.replay.whole_file import descriptor_of, whole_file

TRACE = (
    '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
    '{"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
)
SMALL = ["--quiet", "--block-size", "10", "--capacity", "100"]


def test_descriptor_paths() -> None:
    assert descriptor_of("/dev/stdout") == 1
    assert descriptor_of("/dev/stderr") == 2
    assert descriptor_of("/dev/fd/7") == 7
    assert descriptor_of("/proc/self/fd/12") == 12
    assert descriptor_of("/dev/fd/../stdout") == 1
    assert descriptor_of("/dev/null") is None
    assert descriptor_of("out.json") is None


def test_json_to_a_pipe_is_written(tmp_path: Path) -> None:
    """`kvtier replay t.jsonl --json /dev/stdout | jq`."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    read_fd, write_fd = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        chunks.extend(iter(lambda: os.read(read_fd, 65536), b""))

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        status = main([str(trace), *SMALL, "--json", f"/dev/fd/{write_fd}"])
    finally:
        os.close(write_fd)
        reader.join(timeout=10)
        os.close(read_fd)
    assert status == 0
    assert json.loads(b"".join(chunks))["trace"] == str(trace)


def test_a_redirected_stdout_keeps_what_else_was_written(tmp_path: Path) -> None:
    """`kvtier replay t.jsonl --json /dev/stdout > out.txt`: written through the open
    descriptor, at its offset, not by replacing (or truncating) out.txt."""
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        stdout.write("summary line\n")
        stdout.flush()
        with whole_file(f"/dev/fd/{stdout.fileno()}") as file:
            file.write('{"json": 1}\n')
        stdout.write("table line\n")
    assert out.read_text() == 'summary line\n{"json": 1}\ntable line\n'
    assert os.listdir(tmp_path) == ["out.txt"]


def test_sweep_of_a_trace_whose_name_holds_dollar_signs(tmp_path: Path) -> None:
    trace = tmp_path / "run_$\\foo$.jsonl"
    trace.write_text(TRACE)
    out = tmp_path / "out"
    assert main([str(trace), *SMALL, "--sweep", "--out", str(out)]) == 0
    assert (out / "sweep.png").is_file()


@pytest.mark.parametrize(
    "command",
    [["-m", "kvtier.cli.main", "replay", "{trace}"], ["-m", "kvtier.replay.generate", "{out}"]],
)
def test_a_closed_stderr_does_not_stop_a_command_with_a_progress_bar(
    tmp_path: Path, command: list[str]
) -> None:
    """Regression: with `2>&-` the progress bar (tqdm, writing to stderr) failed, so
    `kvtier replay` printed no table and exited 1."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.jsonl"
    trace.write_text(TRACE)
    argv = [arg.format(trace=trace, out=out) for arg in command]
    if "replay" in argv:
        argv += ["--block-size", "10", "--capacity", "100"]  # not --quiet: the bar is on
    line = shlex.join([sys.executable, *argv]) + " 2>&-"
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    assert "TTFT" in done.stdout if "replay" in argv else out.exists()


def test_a_symbolic_link_to_a_descriptor_names_it(tmp_path: Path) -> None:
    (tmp_path / "out.json").symlink_to("/dev/stdout")
    (tmp_path / "again.json").symlink_to("out.json")  # relative, and a chain
    (tmp_path / "fd7").symlink_to("/dev/fd/7")
    (tmp_path / "file.json").symlink_to(tmp_path / "plain.json")
    assert descriptor_of(tmp_path / "out.json") == 1
    assert descriptor_of(tmp_path / "again.json") == 1
    assert descriptor_of(tmp_path / "fd7") == 7
    assert descriptor_of(tmp_path / "file.json") is None


@pytest.mark.parametrize("stdout_to", ["file", "pipe"])
def test_json_through_a_symbolic_link_to_stdout(tmp_path: Path, stdout_to: str) -> None:
    """`ln -s /dev/stdout r.json; kvtier replay t.jsonl --json r.json > out.txt` (or `| jq`).

    Regression: the link was resolved to what stdout leads to; a redirected out.txt was
    replaced by a new file holding only the JSON (the summary and table printed to stdout
    were lost), and for a pipe the JSON was lost after the whole replay (exit 1, 'No such
    file or directory'), as no temporary file can be made in /proc/PID/fd."""
    trace, link, out = tmp_path / "t.jsonl", tmp_path / "r.json", tmp_path / "out.txt"
    trace.write_text(TRACE)
    link.symlink_to("/dev/stdout")
    argv = [sys.executable, "-m", "kvtier.cli.main", "replay", str(trace), *SMALL]
    argv += ["--json", str(link)]
    if stdout_to == "file":
        with open(out, "w") as stdout:
            done = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, timeout=120)
        printed = out.read_text()
    else:
        done = subprocess.run(argv, capture_output=True, timeout=120)
        printed = done.stdout.decode()
    assert done.returncode == 0, done.stderr
    assert json.loads(printed)["trace"] == str(trace)  # stdout holds the JSON alone
    assert b"TTFT" in done.stderr  # the table went to stderr, as for --json /dev/stdout
    assert os.readlink(link) == "/dev/stdout"  # still the link
    assert set(os.listdir(tmp_path)) <= {"t.jsonl", "r.json", "out.txt"}  # no temporary


def test_a_relative_link_is_read_from_the_folder_it_is_really_in(tmp_path: Path) -> None:
    """A link's relative target counts from the real folder holding the link, as the
    kernel reads it, not from the path given when that runs through a linked folder.

    Regression: `x -> a/b/c` and `a/b/c/r.json -> ../../../../dev/stdout` (from
    /tmp/pytest-of-U/pytest-N/T/x, four `..` lead to /) was taken for stdout, where the
    kernel (and the code before) creates T/../dev/stdout, a file."""
    tmp_path = Path(os.path.realpath(tmp_path))  # counted in real folders
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (tmp_path / "x").symlink_to(deep)
    ups = len(tmp_path.parts)  # from tmp_path/x, as many `..` as lead to /
    (deep / "r.json").symlink_to("../" * ups + "dev/stdout")
    assert os.path.realpath(tmp_path / "x" / "r.json") != "/dev/stdout"
    assert descriptor_of(tmp_path / "x" / "r.json") is None
    (deep / "up.json").symlink_to("../" * (ups + 2) + "dev/stdout")  # from c: to / as well
    assert descriptor_of(tmp_path / "x" / "up.json") == 1


def test_a_folder_probe_removed_by_another_check_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the probe `check_creates_files` makes is named as `prepare_host`'s,
    whose clean-up may remove it meanwhile (a check on another machine, or in another
    pid namespace, sharing the folder); its own removal then raised FileNotFoundError."""
    real_mkstemp = tempfile.mkstemp

    def removed_at_once(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, path = real_mkstemp(*args, **kwargs)
        os.unlink(path)  # another check's clean-up
        return fd, path

    monkeypatch.setattr(outputs.tempfile, "mkstemp", removed_at_once)
    outputs.check_creates_files("--out", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_dash_reads_the_trace_from_stdin_and_writes_the_json_to_stdout(
    tmp_path: Path,
) -> None:
    """`zcat t.jsonl.gz | kvtier replay - --json - | jq`. Regression: `-` was a file name:
    the trace `-` did not exist, and `--json -` wrote a file named `-`."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "replay", "-", *SMALL, "--json", "-"],
        input=TRACE,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["trace"] == "/dev/stdin"
    assert result["token_hit_ratio"]["lru"] == {"100": 0.5}
    assert "2 requests" in done.stderr  # the summary and table moved to stderr
    assert os.listdir(tmp_path) == []
