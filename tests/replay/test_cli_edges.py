"""Edges of `kvtier replay` and the trace generator found by review (a demanding user).

Regressions, each named in its test: outputs under /proc or /sys (root passes
`os.access`) and a descriptor that is not open were found only after the whole run;
`--json /dev/stdout` mixed the summary line into the JSON and reported a closed reader
as an error; a closed stdout (`>&-`) crashed; an interrupted run replaced some of its
files and not others; SIGTERM left the generator's hidden `.part` file; a trace of empty
prompts reported a no-cache TTFT of one token; a partial last block served a full one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import hidden_files, unwrapped

from kvtier.replay import cli as replay_cli
from kvtier.replay import generate, outputs
from kvtier.replay.cli import EXIT_BROKEN_PIPE, main
from kvtier.replay.signals import TERMINATED_STATUS
from kvtier.replay.trace import TraceError, read_trace
from kvtier.replay.whole_file import file_set, whole_file

TRACE = (
    '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
    '{"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
)
SMALL = ["--quiet", "--block-size", "10", "--capacity", "100"]
JSON_TO_STDOUT = ["--sweep", "--json", "/dev/stdout"]


def trace_file(tmp_path: Path, text: str = TRACE) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    return path


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli.main", "replay", *args]


def run_with_stdout_gone(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `argv` with stdout a pipe whose reader left before it started (`| head -c0`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("where", ["/proc/kvtier-x.json", "/sys/kvtier-x.json", "/dev/fd/97"])
def test_an_output_nothing_can_be_written_to_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Regression: as root these passed the check; the replay ran, then failed with status
    1, naming a hidden temporary file instead of the path given."""
    assert main([str(trace_file(tmp_path)), *SMALL, "--json", where]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"kvtier replay: error: --json {where}: ")


def test_a_sweep_folder_under_proc_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(trace_file(tmp_path)), *SMALL, "--sweep", "--out", "/proc/kvtier-x"]) == 2
    assert "--out /proc/kvtier-x: cannot create files in /proc" in capsys.readouterr().err


def test_json_to_stdout_is_pure_json_and_the_rest_goes_to_stderr(tmp_path: Path) -> None:
    """Regression: the trace summary line came first, so `| jq` failed."""
    done = subprocess.run(
        command(str(trace_file(tmp_path)), *SMALL, "--json", "/dev/stdout"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["trace"] == str(tmp_path / "t.jsonl")
    assert "infinite-cache token hit ratio" in done.stderr
    assert "wrote /dev/stdout" in done.stderr


def test_json_to_a_stdout_whose_reader_left_ends_quietly(tmp_path: Path) -> None:
    """`--json /dev/stdout | head -0`: status 141 and no error (with the summary line
    first, `| head -1` used to report "writing the results failed: Broken pipe")."""
    done = run_with_stdout_gone(command(str(trace_file(tmp_path)), *SMALL, *JSON_TO_STDOUT[1:]))
    assert done.returncode == EXIT_BROKEN_PIPE
    assert "error" not in done.stderr


def test_a_closed_stdout_is_no_crash(tmp_path: Path) -> None:
    """Regression: `kvtier replay t.jsonl >&-` ended in AttributeError ('NoneType' object
    has no attribute 'flush')."""
    out = tmp_path / "r.json"
    argv = " ".join(command(str(trace_file(tmp_path)), *SMALL, "--json", str(out)))
    done = subprocess.run(["sh", "-c", f"{argv} >&-"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads(out.read_text())["points"]


def test_an_interrupted_write_replaces_none_of_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: Ctrl-C while the outputs were written left this run's sweep.csv beside
    the last run's sweep.png and JSON."""
    out, result = tmp_path / "out", tmp_path / "r.json"
    out.mkdir()
    for path in (out / "sweep.csv", out / "sweep.png", result):
        path.write_text("old run")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_cli, "write_json", interrupted)  # after the CSV and plot
    argv = [str(trace_file(tmp_path)), *SMALL, "--sweep", "--out", str(out)]
    assert main([*argv, "--json", str(result)]) == replay_cli.EXIT_INTERRUPTED
    for path in (out / "sweep.csv", out / "sweep.png", result):
        assert path.read_text() == "old run"
    assert hidden_files(out) == hidden_files(tmp_path) == []


def test_a_file_set_replaces_its_files_together(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with file_set():
        with whole_file(a) as file:
            file.write("a")
        assert not a.exists(), "renamed only when the set completes"
        with whole_file(b) as file:
            file.write("b")
    assert (a.read_text(), b.read_text()) == ("a", "b")
    assert hidden_files(tmp_path) == []


def test_sigterm_in_the_generator_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `kill` during `python -m kvtier.replay.generate` left a hidden
    `.chat.jsonl.*.part` file of tens of MB."""
    out = tmp_path / "chat.jsonl"

    def write_then_terminated(path: Path, records: object) -> None:
        with whole_file(path) as file:
            file.write("part of a trace\n")
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(generate, "write_trace", write_then_terminated)
    with pytest.raises(SystemExit) as stopped:
        generate.main([str(out), "--conversations", "2"])
    assert stopped.value.code == TERMINATED_STATUS
    assert list(tmp_path.iterdir()) == []
    assert unwrapped(signal.SIGTERM) is signal.SIG_DFL


def test_the_generator_names_an_output_it_cannot_write_before_generating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def generated(config: object) -> None:
        raise AssertionError("the workload was generated before the check")

    monkeypatch.setattr(generate, "generate_chat_trace", generated)
    with pytest.raises(SystemExit) as stopped:
        generate.main(["/proc/kvtier-chat.jsonl", "--conversations", "2"])
    assert stopped.value.code == 2
    assert "out /proc/kvtier-chat.jsonl: cannot create files in /proc" in capsys.readouterr().err


def test_python_m_kvtier_replay_takes_verbose(tmp_path: Path) -> None:
    """`kvtier replay --help` lists -v; `python -m kvtier.replay -v` refused it."""
    argv = [sys.executable, "-m", "kvtier.replay", str(trace_file(tmp_path)), *SMALL, "-v"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_trace_of_empty_prompts_costs_nothing_without_a_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the no-cache TTFT counted one token for a trace of zero tokens."""
    empty = '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n'
    result = tmp_path / "r.json"
    assert main([str(trace_file(tmp_path, empty)), *SMALL, "--json", str(result)]) == 0
    for point in json.loads(result.read_text())["points"]:
        assert point["mean_ttft_no_cache_s"] == point["mean_ttft_s"] == 0
        assert point["token_hit_ratio"] == 0


def test_a_partial_block_id_reused_as_a_full_block_is_refused(tmp_path: Path) -> None:
    """Regression: the id of a 10-token partial block served the same id's 512 tokens."""
    trace = trace_file(
        tmp_path,
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n',
    )
    with pytest.raises(TraceError, match=r"t.jsonl:2: hash_ids\[0\] = 1 covers 512 tokens, but 10"):
        read_trace(trace, 512)


def test_the_sweep_files_stay_when_the_reader_of_the_json_leaves(tmp_path: Path) -> None:
    """Regression (review of the file set): `--sweep --out D --json /dev/stdout | head -c0`
    lost D's CSV and plot with the JSON."""
    out = tmp_path / "out"
    argv = command(str(trace_file(tmp_path)), *SMALL, "--out", str(out), *JSON_TO_STDOUT)
    done = run_with_stdout_gone(argv)
    assert done.returncode == EXIT_BROKEN_PIPE
    assert "error" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.png"]


def test_json_to_stdout_stays_pure_with_stderr_closed(tmp_path: Path) -> None:
    """Regression: with `2>&-` the table was printed into stdout's JSON."""
    argv = " ".join(command(str(trace_file(tmp_path)), *SMALL, "--json", "/dev/stdout"))
    done = subprocess.run(["sh", "-c", f"{argv} 2>&-"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert json.loads(done.stdout)["points"]


def test_json_to_stdout_stays_pure_when_stderr_s_reader_left(tmp_path: Path) -> None:
    """`--json /dev/stdout 2>&1 >x | head -0`: stderr, which takes the summary and the
    table, breaks at its first line; the rest is dropped, not printed into the JSON."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        argv = command(str(trace_file(tmp_path)), *SMALL, "--json", "/dev/stdout")
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=write_end, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0
    assert json.loads(done.stdout)["points"]


def test_an_existing_file_that_is_not_writable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the folder probe alone let a read-only result file be replaced (as a
    user other than root; root may replace it, as its shell would)."""
    result = tmp_path / "r.json"
    result.write_text("kept")
    real_access = os.access
    monkeypatch.setattr(
        outputs.os, "access", lambda p, mode: Path(p) != result and real_access(p, mode)
    )
    assert main([str(trace_file(tmp_path)), *SMALL, "--json", str(result)]) == 2
    assert f"--json {result}: the file is not writable" in capsys.readouterr().err
    assert result.read_text() == "kept"


def test_the_generator_writes_a_pure_trace_to_stdout_with_stderr_closed(tmp_path: Path) -> None:
    """Regression (review): with `2>&-` the "wrote" line ended the trace again."""
    argv = f"{sys.executable} -m kvtier.replay.generate /dev/stdout --conversations 2 2>&-"
    done = subprocess.run(["sh", "-c", argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    trace = tmp_path / "chat.jsonl"
    trace.write_text(done.stdout)
    assert read_trace(trace)
