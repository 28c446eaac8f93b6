"""A Ctrl-C as `kvtier` exits (its command ended and cleaned up) ends the process quietly.

Regression: a second Ctrl-C just after the first (or one as a finished command exits)
landed in the interpreter's shutdown (atexit callbacks, joining threads) and printed
"Exception ignored in ..." with a KeyboardInterrupt traceback; seen in 7 of 40 runs of
`kvtier demo` given two SIGINTs 0-30 ms apart.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Ctrl-C from an atexit callback: as the interpreter shuts down after `main` returned.
CTRL_C_AT_EXIT = """
import atexit, os, signal, sys, time

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here

atexit.register(ctrl_c)
sys.argv = ["kvtier", *{argv!r}]
from kvtier.cli.main import main
sys.exit(main())
"""


@pytest.mark.parametrize("first_ctrl_c", [False, True])
def test_ctrl_c_as_the_command_exits_is_no_traceback(tmp_path: Path, first_ctrl_c: bool) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--quiet", "--block-size", "20"]
    code = CTRL_C_AT_EXIT.format(argv=argv)
    if first_ctrl_c:  # the first Ctrl-C stops the replay; the second comes at exit
        code = code.replace(
            "from kvtier.cli.main import main",
            "from kvtier.replay import cli\n"
            "cli.run_sweep = lambda *a: os.kill(os.getpid(), signal.SIGINT)\n"
            "from kvtier.cli.main import main",
        )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert done.returncode == -signal.SIGINT  # ended by the signal, as the shell expects
    if first_ctrl_c:
        assert done.stderr == "\nkvtier replay: interrupted\n"
    else:
        assert "TTFT" in done.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ignored_from_the_start_stays_ignored_at_exit(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """`kvtier replay ... &` in a script starts with SIGINT ignored (so that Ctrl-C for the
    script's foreground job leaves it be); `nohup`-like launchers ignore SIGTERM.

    Regression: as the command exited, the ignored signal was given its default action,
    so one sent then (here from an atexit callback) killed the process."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--quiet", "--block-size", "20"]
    code = CTRL_C_AT_EXIT.format(argv=argv).replace("signal.SIGINT", f"signal.{signum.name}")
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signum, signal.SIG_IGN),  # inherited, as from a shell
    )
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout


# Ctrl-C as `main` starts to give the signals their default action (before the swap).
CTRL_C_AS_THE_SIGNALS_END = """
import signal, sys
import kvtier.replay.signals as signals

real = signals.signals_end_the_process
calls = []

def ctrl_c_first(*args):
    calls.append(args)
    if len(calls) == 1:
        signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is raised here
    real(*args)

signals.signals_end_the_process = ctrl_c_first
sys.argv = ["kvtier", *{argv!r}]
from kvtier.cli.main import main
sys.exit(main())
"""


def test_ctrl_c_as_the_finished_command_gives_up_its_handlers_is_not_lost(
    tmp_path: Path,
) -> None:
    """Regression: a Ctrl-C whose KeyboardInterrupt came as `main` began to give SIGINT its
    default action was caught there and dropped: the process exited 0, as if no Ctrl-C."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--quiet", "--block-size", "20"]
    code = CTRL_C_AS_THE_SIGNALS_END.format(argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr
    assert done.returncode == -signal.SIGINT, done.stderr
    assert "TTFT" in done.stdout  # the command had finished


# Ctrl-C as `main` puts the caller's handlers back, before it swaps the first one: after a
# command that held signals (`--json`'s rename set), whose wrapper stays in place then.
CTRL_C_BEFORE_THE_HANDLERS_ARE_BACK = """
import os, signal, sys, time, weakref
import kvtier.replay.command as command

real = command._restore_signal_handlers
calls = []

def ctrl_c_first(previous):
    calls.append(previous)
    if len(calls) == 1:
        signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is raised here
    real(previous)

command._restore_signal_handlers = ctrl_c_first

class Held:
    pass

def ctrl_c_again():  # a finalizer run at exit (as torch's are): one more Ctrl-C lands there
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here

held = Held()
weakref.finalize(held, ctrl_c_again)
sys.argv = ["kvtier", *{argv!r}]
from kvtier.cli.main import main
sys.exit(main())
"""


def test_ctrl_c_before_the_handlers_are_back_still_ends_the_process_at_exit(
    tmp_path: Path,
) -> None:
    """Regression: a Ctrl-C landing as `main` began to put the handlers back, after a
    command that had held signals (`signals_deferred` leaves its wrapper of Python's
    handler in place), left that wrapper in place; at exit it was not taken for Python's
    handler, so one more Ctrl-C raised KeyboardInterrupt inside the interpreter's
    shutdown: "Exception ignored in atexit callback" and a traceback, seen with
    `kvtier demo` given 2-5 SIGINTs 10-50 ms apart (4 of 18 runs)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--quiet", "--block-size", "20", "--json", str(tmp_path / "r")]
    code = CTRL_C_BEFORE_THE_HANDLERS_ARE_BACK.format(argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Exception ignored" not in done.stderr
    assert "Traceback" not in done.stderr
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stderr == "\nkvtier: interrupted\n"
    assert (tmp_path / "r").exists()  # the command had finished


# The command's frames hold an object whose finalizer runs as the interrupted command's
# exception is dropped (as an engine's or a tier's do): a second Ctrl-C lands there.
CTRL_C_IN_A_FINALIZER_OF_THE_INTERRUPTED_COMMAND = """
import os, signal, sys, time, weakref
from kvtier.replay import cli

class Engine:
    pass

def ctrl_c_again():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here

def interrupted_sweep(*args):
    engine = Engine()
    weakref.finalize(engine, ctrl_c_again)
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C
    time.sleep(1)

cli.run_sweep = interrupted_sweep
sys.argv = ["kvtier", *{argv!r}]
from kvtier.cli.main import main
sys.exit(main())
"""


def test_ctrl_c_in_a_finalizer_as_the_interrupted_command_ends_is_no_traceback(
    tmp_path: Path,
) -> None:
    """Regression: the objects an interrupted command's frames held (the demo's engine,
    its tiers) were freed as `kvtier` printed "interrupted", their finalizers running
    with Ctrl-C live: a second Ctrl-C landing in one printed "Exception ignored in:
    <finalize object ...>" and a KeyboardInterrupt traceback (`kvtier demo` given 5
    SIGINTs 10 ms apart, 1 of 12 runs). It now waits for them, then ends the process."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--quiet", "--block-size", "20"]
    code = CTRL_C_IN_A_FINALIZER_OF_THE_INTERRUPTED_COMMAND.format(argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Exception ignored" not in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("\nkvtier replay: interrupted\n"), done.stderr
    assert done.returncode in (130, -signal.SIGINT), done.stderr
