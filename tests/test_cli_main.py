"""The `kvtier` command: it ends quietly on a closed pipe or Ctrl-C; its help gives defaults."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from closed_pipe import run_into_closed_pipe
from kvtier.cli.main import BROKEN_PIPE_STATUS, build_parser, main, parse_arguments
from kvtier.replay import cli as replay_cli

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]  # what the `kvtier` script runs


def write_trace(path: Path, num_requests: int = 20) -> Path:
    """Write a small Mooncake-format trace: requests sharing a two-block prefix."""
    lines = [
        json.dumps(
            {
                "timestamp": 100 * i,
                "input_length": 2048,
                "output_length": 8,
                "hash_ids": [1, 2, 100 + 2 * i, 101 + 2 * i],
            }
        )
        for i in range(num_requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_into_a_closed_pipe_exits_without_a_traceback(tmp_path: Path) -> None:
    # Regression: `kvtier replay t.jsonl | head -1` printed a BrokenPipeError traceback.
    # The read end is closed before the command writes, so every write meets EPIPE.
    trace = write_trace(tmp_path / "trace.jsonl")
    command = [*KVTIER, "replay", str(trace), "--quiet"]
    status, stderr = run_into_closed_pipe(command)
    assert status == BROKEN_PIPE_STATUS, stderr
    assert stderr == ""


def test_replay_piped_into_head_prints_its_first_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    command = " ".join([*KVTIER, "replay", str(trace), "--quiet", "| head -1"])
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (0, BROKEN_PIPE_STATUS), done.stderr  # 0: all fit the pipe
    assert done.stdout.startswith(f"{trace}: 20 requests")
    assert done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr


class ClosedPipe:
    """A stdout whose reader has gone, and which has no file descriptor."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise OSError("no file descriptor")


def test_main_returns_the_broken_pipe_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["replay", str(trace), "--quiet"]) == BROKEN_PIPE_STATUS


def interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["kvtier", "python -m kvtier.replay"])
def test_ctrl_c_ends_replay_with_one_line_and_status_130(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    # Regression: Ctrl-C printed a KeyboardInterrupt traceback.
    trace = write_trace(tmp_path / "trace.jsonl")
    monkeypatch.setattr(replay_cli, "run_sweep", interrupt)
    try:
        if command == "kvtier":
            status = main(["replay", str(trace), "--quiet"])
        else:
            status = replay_cli.main([str(trace), "--quiet"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped: the user sees a traceback")
    assert status == 130
    assert capsys.readouterr().err == "\nkvtier replay: interrupted\n"


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvtier {kvtier.__version__}\n"


def test_python_m_kvtier_runs_the_kvtier_command() -> None:
    # Regression: `python -m kvtier` failed ("kvtier is a package and cannot be directly
    # executed"); the script's folder is not always on PATH.
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"kvtier {kvtier.__version__}\n", "")
    usage = subprocess.run(
        [sys.executable, "-m", "kvtier", "replay"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 2
    assert usage.stderr.startswith("usage: kvtier replay ")


def test_every_option_of_every_command_states_its_default() -> None:
    # Regression: `kvtier replay --help` gave no default for --cascade and --json.
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    for name, parser in subparsers.choices.items():
        for action in parser._actions:
            if action.option_strings and action.nargs != 0:  # an option taking a value
                assert "default" in (action.help or "").lower(), (name, action.option_strings)


def test_the_readme_shows_every_command_and_its_command_lines_parse() -> None:
    # Regression: the README never showed `kvtier replay`, which `kvtier --help` lists.
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = readme.split("```")[1::2]  # the fenced code blocks
    lines = [
        line.split("#")[0]
        for block in blocks
        for line in block.splitlines()
        if line.startswith("kvtier ")
    ]
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    shown = {shlex.split(line)[1] for line in lines}
    assert shown >= set(subparsers.choices) - {"demo"}  # the demo: `make demo`, --help
    for line in lines:
        build_parser().parse_args(shlex.split(line)[1:])  # a usage error exits


def test_help_and_replay_do_not_import_the_engine(tmp_path: Path) -> None:
    # Regression: building the parser imported the demo's engine (torch, rich), so
    # `kvtier --help` and every `kvtier replay` spent ~4 s importing it first.
    trace = write_trace(tmp_path / "trace.jsonl")
    code = (
        "import sys\nfrom kvtier.cli.main import main\n"
        f"main(['replay', {str(trace)!r}, '--quiet'])\n"
        "print(sorted({'torch', 'rich', 'kvtier.engine'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["replay", "t.jsonl"], False),
        (["-v", "replay", "t.jsonl"], True),
        (["replay", "t.jsonl", "-v"], True),  # regression: "unrecognized arguments: -v"
        (["demo", "--verbose"], True),
    ],
)
def test_verbose_is_taken_before_or_after_the_command(argv: list[str], verbose: bool) -> None:
    assert build_parser().parse_args(argv).verbose is verbose


@pytest.mark.parametrize("command", ["replay", "demo", "generate"])
def test_an_unknown_option_shows_the_usage_of_its_command(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: `kvtier replay t.jsonl --bogus` printed the top-level usage line
    # (`kvtier [-h] [-v] [--version] COMMAND ...`), which shows none of replay's options.
    argv = [command, "t.jsonl", "--bogus"] if command != "demo" else [command, "--bogus"]
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(build_parser(), argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvtier {command} ")
    assert err.endswith(f"kvtier {command}: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize(
    ("command", "argv", "error"),
    [
        ("kvtier", ["replay", "t.jsonl", "--capacity", "-1M"], "--cpu: invalid token count '-1M'"),
        ("kvtier", ["demo", "--cpu-mib", "-1e3"], "--cpu-mib: invalid integer '-1e3'"),
        ("replay", ["t.jsonl", "--cpu", "-1.5k"], "--cpu: invalid token count '-1.5k'"),
        ("replay", ["t.jsonl", "--cpu-link-gbps", "-1e3"], "must be >= 1e-06 and finite"),
        ("generate", ["t.jsonl", "--seed", "-1e3"], "--seed: invalid integer '-1e3'"),
        ("kvtier", ["generate", "t.jsonl", "--seed", "-1e3"], "--seed: invalid integer '-1e3'"),
    ],
)
def test_a_value_like_minus_1m_is_reported_by_its_option(
    command: str, argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: argparse took "-1M" for an option and said only "expected one argument".
    from kvtier.replay import generate

    parse = {
        "kvtier": lambda: parse_arguments(build_parser(), argv),
        "replay": lambda: replay_cli.parse_arguments(argv),
        "generate": lambda: generate.main(argv),
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert error in err
    assert "expected one argument" not in err


def test_only_a_long_option_takes_the_dashed_number_after_it() -> None:
    from kvtier.replay.option_types import attach_dashed_values

    assert attach_dashed_values(["--cpu", "-1M", "--gpu=-2k", "-v", "-3G"]) == [
        "--cpu=-1M",
        "--gpu=-2k",
        "-v",
        "-3G",
    ]
    assert attach_dashed_values(["--cpu", "-x", "--", "--out", "-1"]) == [
        "--cpu",
        "-x",
        "--",
        "--out",
        "-1",
    ]
    assert attach_dashed_values(["t.jsonl", "--cpu"]) == ["t.jsonl", "--cpu"]


def test_kvtier_without_a_command_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by a mutation run (s29): an optional COMMAND passed every test (bare `kvtier`
    then had no command to run)."""
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtier [-h] [-v] [--version] COMMAND ...\n")
    assert err.endswith("kvtier: error: the following arguments are required: COMMAND\n")
