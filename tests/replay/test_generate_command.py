"""`kvtier generate`: the chat workload generator as a `kvtier` subcommand, the same
command as `python -m kvtier.replay.generate` (same options, checks and output)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.main import BROKEN_PIPE_STATUS, main
from kvtier.replay import generate
from kvtier.replay.trace import read_trace


def test_kvtier_generate_writes_the_trace_the_module_writes(tmp_path: Path) -> None:
    by_command, by_module = tmp_path / "command.jsonl", tmp_path / "module.jsonl"
    assert main(["generate", str(by_command), "--conversations", "3", "--seed", "7"]) == 0
    assert generate.main([str(by_module), "--conversations", "3", "--seed", "7"]) == 0
    assert by_command.read_bytes() == by_module.read_bytes()
    assert len(read_trace(by_command)) > 3  # conversations of several turns


def test_kvtier_generate_runs_as_a_program(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "generate", str(out), "--conversations", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {len(read_trace(out))} requests to {out}\n"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--conversations", "0"], "argument --conversations: must be 1 ... 100000, got 0"),
        (["--block-size", "0"], "argument --block-size: must be 1 ... 1048576, got 0"),
        (["--seed", "x"], "argument --seed: invalid integer 'x'"),
        (["--seed", "1", "--seed", "2"], "argument --seed: given twice ('1', then '2')"),
    ],
)
def test_a_bad_option_is_named_with_its_value(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(out), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtier generate ")
    assert f"kvtier generate: error: {error}" in err
    assert not out.exists()


def test_the_help_states_each_range_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.startswith("usage: kvtier generate ")
    assert "random seed, 0 ... 2**64-1 (default 0)" in help_text
    assert "number of conversations, 1 ... 100,000 (default 600)" in help_text
    assert "tokens per hash block, 1 ... 1,048,576 (default 512)" in help_text


def test_a_dash_writes_the_trace_to_stdout_for_replay_to_read(tmp_path: Path) -> None:
    """Regression: `kvtier generate - | kvtier replay -` wrote a file named `-` in the
    current folder and "wrote N requests to -" into the pipe, so replay failed on that
    line; `-` is stdout, as replay's trace `-` is stdin and its `--json -` stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "generate", "-", "--conversations", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []  # no file named `-`
    trace = tmp_path / "chat.jsonl"
    trace.write_text(done.stdout)
    assert len(read_trace(trace)) > 2
    assert done.stderr == f"wrote {len(read_trace(trace))} requests to /dev/stdout\n"


@pytest.mark.parametrize("program", ["kvtier.cli.main", "kvtier.replay.generate"])
def test_a_reader_that_leaves_ends_generate_quietly(program: str, tmp_path: Path) -> None:
    """Regression: `kvtier generate - | head -1` ended in a usage error (status 2, the
    usage lines and 'cannot write /dev/stdout: Broken pipe' on stderr), where every
    other kvtier output piped into a reader that stops early ends quietly with 141."""
    args = [program, "generate"] if program == "kvtier.cli.main" else [program]
    reader_gone = subprocess.Popen(
        [sys.executable, "-m", *args, "-", "--conversations", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert reader_gone.stdout is not None
    reader_gone.stdout.close()  # before the trace is written: its first write breaks
    _, stderr = reader_gone.communicate(timeout=120)
    assert (reader_gone.returncode, stderr) == (BROKEN_PIPE_STATUS, "")
    assert list(tmp_path.iterdir()) == []
