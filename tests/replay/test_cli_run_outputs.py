"""`kvtier replay`'s lines, plot, failures while writing, and its entry points: what the
summary and the table's footnote print, what the plot is given, an interrupted or
failed write, `main()` reading `sys.argv`, and `run` called on its own."""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay import ReplayConfig, TierConfig, cli, replay_trace
from kvtier.replay.trace import summarize, write_trace

RECORDS = doc_trace(seed=5, num_requests=60)


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "doc.jsonl"
    write_trace(path, RECORDS)
    return path


def _argv(tmp_path: Path) -> list[str]:
    return [str(_trace(tmp_path)), "--block-size", str(BLOCK), "--capacity", "80", "--quiet"]


def test_the_summary_and_footnote_give_ratio_and_ttft_to_three_decimals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(_argv(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    ratio = re.search(r", infinite-cache token hit ratio (\d+\.\d+)$", lines[0])
    assert ratio is not None, lines[0]
    assert len(ratio.group(1)) == 5  # 0.382
    assert abs(float(ratio.group(1)) - summarize(RECORDS, BLOCK).infinite_token_hit_ratio) < 5e-4
    no_cache = re.search(r"\(without any cache: (\d+\.\d+) s\)$", lines[-1])
    assert no_cache is not None, lines[-1]
    assert len(no_cache.group(1)) == 5  # 0.004, not 0.00
    config = ReplayConfig(tiers=(TierConfig.named("CPU", 80),), block_size=BLOCK)
    expected = replay_trace(RECORDS, config).mean_ttft_no_cache_s
    assert abs(float(no_cache.group(1)) - expected) < 5e-4


def test_usage_errors_name_kvtier_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(tmp_path / "t.jsonl"), "--capacity", "lots"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtier replay ")
    assert "\nkvtier replay: error: argument --capacity/--cpu: " in err


def test_the_mounted_command_keeps_the_examples_laid_out() -> None:
    """`kvtier replay --help` prints the description's example lines as written."""
    parser = argparse.ArgumentParser(prog="kvtier")
    subparsers = parser.add_subparsers(dest="command")
    cli.add_parser(subparsers)
    text = subparsers.choices["replay"].format_help()
    assert "\nexamples:\n  kvtier replay trace.jsonl --policy lru --policy lfuda" in text


def test_the_plot_is_titled_with_the_trace_file_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """And given the infinite-cache hit ratio, its ceiling line."""
    plotted: list[tuple[str, float]] = []

    def plot_sweep(path: Path, points: Any, title: str, infinite_hit_ratio: float) -> None:
        path.write_bytes(b"")
        plotted.append((title, infinite_hit_ratio))

    monkeypatch.setattr(cli, "plot_sweep", plot_sweep)
    assert cli.main([*_argv(tmp_path), "--sweep", "--out", str(tmp_path / "out")]) == 0
    assert plotted == [("doc.jsonl", summarize(RECORDS, BLOCK).infinite_token_hit_ratio)]


def test_a_json_file_whose_reader_left_is_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json naming a pipe (not stdout) whose reader went away: the results were not
    written, status 1, and the table still goes to stdout (whose reader is there)."""

    def reader_left(*args: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "write_json", reader_left)
    assert cli.main([*_argv(tmp_path), "--json", str(tmp_path / "r.json")]) == 1
    out, err = capsys.readouterr()
    assert "kvtier replay: error: writing the results failed: [Errno 32] Broken pipe" in err
    assert "TTFT s" in out


def test_ctrl_c_while_the_files_are_written_removes_the_folders_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def ctrl_c(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_csv", ctrl_c)
    trace = _argv(tmp_path)
    assert cli.main([*trace, "--sweep", "--out", str(tmp_path / "new" / "sub")]) == 130
    assert capsys.readouterr().err == "\nkvtier replay: interrupted\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.jsonl"]


class _GoneReader(io.StringIO):
    """A stdout whose reader left: writes are buffered, the flush fails."""

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_run_on_its_own_reports_a_reader_that_left_at_the_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` (public, for a program that parses the options itself) ends with 141 when
    stdout's reader is gone by the time the output is flushed."""
    args = cli.parse_arguments(_argv(tmp_path))
    monkeypatch.setattr(sys, "stdout", _GoneReader())
    assert cli.run(args) == 141


MAIN_FROM_ARGV = """
import atexit, os, signal, sys, time

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here

atexit.register(ctrl_c)
sys.argv = ["kvtier-replay", *{argv!r}]
from kvtier.replay.cli import main
sys.exit(main())
"""


def test_main_without_argv_reads_sys_argv_and_ends_the_process_on_ctrl_c_at_exit(
    tmp_path: Path,
) -> None:
    """`main()` is a program's whole command: it parses `sys.argv[1:]`, and a Ctrl-C as
    the process then exits ends it by the signal, not with a traceback."""
    code = MAIN_FROM_ARGV.format(argv=_argv(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert "TTFT s" in done.stdout
    assert done.returncode == -signal.SIGINT


def test_a_json_name_too_long_for_the_file_system_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name longer than the file system takes (ENAMETOOLONG) is a usage error naming
    the option, the path and the limit, found before the run (nothing on stdout)."""
    too_long = str(tmp_path / ("x" * 300 + ".json"))
    assert cli.main([*_argv(tmp_path), "--json", too_long]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"kvtier replay: error: --json {too_long}: the name xxxxxxxxxxxxxxxx...")
    assert "is 305 bytes long, more than the 255 a file name can have here" in err


def test_a_sweep_folder_name_too_long_is_refused_before_the_sweep_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--sweep --out new/<300 bytes>`: the sweep used to run to its end and then fail
    writing ("writing the results failed: [Errno 36] File name too long"); the name is
    now refused before the run, and no folder is made."""
    trace = _trace(tmp_path)
    out_folder = tmp_path / "new" / ("y" * 300)
    argv = [str(trace), "--block-size", str(BLOCK), "--sweep", "--quiet", "--out", str(out_folder)]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"kvtier replay: error: --out {out_folder}: the name yyyy")
    assert not (tmp_path / "new").exists()


RUN_ON_ITS_OWN = """
import sys
from kvtier.replay import cli
sys.exit(cli.run(cli.parse_arguments({argv!r})))
"""


def test_run_on_its_own_leaves_no_broken_pipe_for_the_interpreter_s_exit(tmp_path: Path) -> None:
    """`run` with stdout's reader gone before it starts (`| head -c0`): status 141 and
    nothing more, not "Exception ignored ... BrokenPipeError" as the interpreter flushes
    the lines left in stdout's buffer at exit."""
    code = RUN_ON_ITS_OWN.format(argv=_argv(tmp_path))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write_end)
    assert done.stderr == b""
    assert done.returncode == 141
