"""Signals around `kvtier replay`'s file writes (review regressions, each named in its
test): Ctrl-C or SIGTERM while a file set is renamed, or while the handlers are wrapped,
must leave either the old files or the new ones, and no temporary file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import hidden_files, unwrapped

from kvtier.replay import whole_file as whole_file_module
from kvtier.replay.signals import TERMINATED_STATUS, signals_deferred, sigterm_unwinds
from kvtier.replay.trace import read_trace
from kvtier.replay.whole_file import file_set, whole_file


def test_ctrl_c_while_a_file_set_is_renamed_waits_for_the_last_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: Ctrl-C between two renames left a new sweep.csv beside an old plot."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("old")
    b.write_text("old")
    real_replace = whole_file_module._replace

    def replace_then_interrupted(temp: str, target: Path) -> None:
        real_replace(temp, target)
        os.kill(os.getpid(), signal.SIGINT)

    def write_both() -> None:
        with file_set():
            for path in (a, b):
                with whole_file(path) as file:
                    file.write("new")

    monkeypatch.setattr(whole_file_module, "_replace", replace_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_both()
    assert (a.read_text(), b.read_text()) == ("new", "new")
    assert hidden_files(tmp_path) == []


def test_signals_deferred_delivers_what_arrived_after_the_block() -> None:
    steps = []

    def interrupted_block() -> None:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("after the signal")  # it waits for the block's end

    with pytest.raises(KeyboardInterrupt):
        interrupted_block()
    assert steps == ["after the signal"]
    assert unwrapped(signal.SIGINT) is signal.default_int_handler


def test_the_generator_writes_a_pure_trace_to_stdout(tmp_path: Path) -> None:
    """Regression: "wrote N requests to /dev/stdout" ended the trace it had written, so
    `generate /dev/stdout | kvtier replay /dev/stdin` failed on that line."""
    argv = [sys.executable, "-m", "kvtier.replay.generate", "/dev/stdout", "--conversations", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "chat.jsonl"
    trace.write_text(done.stdout)
    assert read_trace(trace)
    assert "wrote" in done.stderr


@pytest.mark.parametrize("order", ["before", "after"])  # the signal runs before the swap, or after
@pytest.mark.parametrize("at_call", [1, 2])  # wrapping SIGINT's handler, SIGTERM's
def test_a_signal_as_the_handlers_are_wrapped_leaves_none_holding(
    monkeypatch: pytest.MonkeyPatch, at_call: int, order: str
) -> None:
    """Regression (reviews): a signal run as `signal.signal` was called left a holding
    handler installed, so a later SIGTERM or Ctrl-C did nothing. In CPython it runs
    before the handler changes (in signal.py's wrapper); the test tries both orders.
    Handlers are now wrapped once and never swapped back."""
    before = {s: unwrapped(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for signum, handler in before.items():  # unwrapped, as in a fresh process
        signal.signal(signum, handler)
    real_signal = signal.signal
    calls = []

    def signal_and_interrupted(signum: int, handler: object) -> object:
        calls.append(signum)
        if len(calls) == at_call and order == "before":
            raise KeyboardInterrupt
        previous = real_signal(signum, handler)  # type: ignore[arg-type]
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return previous

    monkeypatch.setattr(signal, "signal", signal_and_interrupted)
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        pass
    monkeypatch.undo()
    assert {s: unwrapped(s) for s in before} == before
    with pytest.raises(KeyboardInterrupt):  # and a signal is held, then delivered
        interrupted_in_a_hold()


def interrupted_in_a_hold() -> None:
    with signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_held_while_the_block_raises_still_arrives() -> None:
    """Regression (review): Ctrl-C held in a block that then failed was dropped, so the
    command ended as for the failure (status 1 or 2), not as interrupted (130)."""

    def failing_block() -> None:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("the write failed")

    with pytest.raises(KeyboardInterrupt):
        failing_block()


def test_an_ignored_signal_does_not_hide_the_next_one() -> None:
    """Regression (review): with SIGINT ignored (`cmd &`), a SIGTERM held after it was
    dropped: only the first held signal was delivered."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        def both_signals() -> None:
            with sigterm_unwinds(), signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(SystemExit) as stopped:
            both_signals()
        assert stopped.value.code == TERMINATED_STATUS
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_signal_stays_ignored_for_child_processes() -> None:
    """`kvtier replay ... &` starts with SIGINT ignored: holding signals around a write
    leaves it ignored (not wrapped in a Python handler, which a child process started
    afterwards would not inherit: Ctrl-C for the script would reach it)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_deferred():
            pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        child = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        assert done.stdout == "True\n"
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_signal_as_a_file_set_ends_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review): Ctrl-C between the block's end and the renames' signal hold
    left every `.part` file of the set."""
    a = tmp_path / "a"
    a.write_text("old")
    real_deferred = whole_file_module.signals_deferred

    def interrupted_on_entry() -> object:
        monkeypatch.setattr(whole_file_module, "signals_deferred", real_deferred)
        raise KeyboardInterrupt

    def write() -> None:
        with file_set():
            with whole_file(a) as file:
                file.write("new")
            monkeypatch.setattr(whole_file_module, "signals_deferred", interrupted_on_entry)

    with pytest.raises(KeyboardInterrupt):
        write()
    assert a.read_text() == "old"
    assert hidden_files(tmp_path) == []
