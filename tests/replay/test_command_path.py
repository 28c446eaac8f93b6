"""`run_command`, the path every kvtier command runs on (`kvtier.replay.command`): the
output flushed before the status is returned, SIGTERM swallowed in a finalizer still
ending the command, `-v`'s log level, the caller's handlers put back (also one Python
did not set, and with a Ctrl-C as they are), and what an interrupted command's frames
held freed before it returns."""

from __future__ import annotations

import argparse
import gc
import io
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK, doc_trace

from finalizers import sigterm_inside_a_finalizer
from kvtier.replay.command import run_command
from kvtier.replay.trace import write_trace


def _command(run: Callable[[argparse.Namespace], int]) -> int:
    """Run `run` as a command named `t` on `run_command`."""

    def parse(argv: object) -> argparse.Namespace:
        return argparse.Namespace(command="t", verbose=False, run=run)

    return run_command([], ends_the_process=False, parse=parse)


class _GoneReader(io.StringIO):
    """A stdout whose reader left: writes are buffered, the flush fails."""

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_output_whose_reader_left_shows_at_the_command_s_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command that printed without flushing: stdout is flushed before the status is
    returned, so a reader that left gives 141 (not 0, then a broken pipe at exit)."""

    def run(args: argparse.Namespace) -> int:
        print("a line for a reader that left")
        return 0

    monkeypatch.setattr(sys, "stdout", _GoneReader())
    assert _command(run) == 141


class _Thing:
    pass


def test_a_sigterm_swallowed_in_a_finalizer_ends_the_command() -> None:
    """SIGTERM whose SystemExit a finalizer swallowed: the command ends with status 143
    (128 + SIGTERM, what a shell reports for `kill`) when it returns, instead of its own
    status."""

    def run(args: argparse.Namespace) -> int:
        sigterm_inside_a_finalizer()
        return 0

    with pytest.raises(SystemExit) as exit_info:
        _command(run)
    assert exit_info.value.code == 128 + signal.SIGTERM


def test_verbose_logs_at_info_and_quiet_at_warning(tmp_path: Path) -> None:
    """`-v` sets the log level (its own process: pytest's handlers would keep
    `logging.basicConfig` from configuring)."""
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=20))
    argv = [sys.executable, "-m", "kvtier.replay", str(trace), "--block-size", str(BLOCK)]
    argv += ["--capacity", "40", "--quiet"]
    verbose = subprocess.run([*argv, "-v"], capture_output=True, text=True, timeout=120)
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stderr.startswith("INFO kvtier.replay.sweep: lru at 40 tokens: ")
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0
    assert plain.stderr == ""


def test_a_handler_set_outside_python_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`signal.getsignal` gives None for a handler a C program set before Python ran: it
    cannot be put back with `signal.signal`, so it is not touched."""
    real = signal.getsignal

    def getsignal(signum: int) -> Any:
        return None if signum == signal.SIGTERM else real(signum)

    monkeypatch.setattr(signal, "getsignal", getsignal)
    assert _command(lambda args: 0) == 0


def test_a_ctrl_c_as_the_handlers_are_put_back_is_not_lost(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C pending as the caller's SIGINT handler is put back runs the handler in
    place (KeyboardInterrupt) before the swap: the swap is done again, and the command
    ends as interrupted."""

    def mine(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGINT, mine)
    real = signal.signal
    pending = [True]

    def swap(signum: int, handler: Any) -> Any:
        if signum == signal.SIGINT and handler is mine and pending:
            pending.clear()
            raise KeyboardInterrupt  # as the pending Ctrl-C's handler does
        return real(signum, handler)

    try:
        monkeypatch.setattr(signal, "signal", swap)
        assert _command(lambda args: 0) == 130
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not pending
    assert capsys.readouterr().err == "\nkvtier: interrupted\n"


def test_an_interrupted_command_s_cyclic_garbage_is_freed_before_it_returns() -> None:
    """What the interrupted frames held in reference cycles (a torch module's) is
    collected while Ctrl-C waits, not at a later collection outside that hold."""
    freed: list[bool] = []

    def run(args: argparse.Namespace) -> int:
        cycle = _Thing()
        cycle.itself = cycle  # type: ignore[attr-defined]
        weakref.finalize(cycle, freed.append, True)
        raise KeyboardInterrupt

    was_enabled = gc.isenabled()
    gc.disable()  # only the command's own collection may free the cycle
    try:
        assert _command(run) == 130
        assert freed == [True]
    finally:
        if was_enabled:
            gc.enable()
