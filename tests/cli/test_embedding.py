"""A program that imports kvtier and calls `kvtier.cli.main.main()` keeps its Ctrl-C.

Regression: `main()` without arguments took itself for the whole process (the `kvtier`
script) and gave SIGINT its default action as it returned, so the calling program's
handler (or Python's KeyboardInterrupt) was gone: its next Ctrl-C killed it outright.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRACE = '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n'

# The embedding program: calls `main()` twice (a run, then a usage error), then reports
# its SIGINT handler and takes a Ctrl-C, then another from an atexit callback.
EMBEDDER = """
import atexit, os, signal, sys, time

def mine(signum, frame):
    print("handled", flush=True)

if {own_handler!r}:
    signal.signal(signal.SIGINT, mine)
before = signal.getsignal(signal.SIGINT)

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs here

from kvtier.cli.main import main
for argv in ({argv!r}, ["replay", "--no-such-option"]):
    sys.argv = ["embedder", *argv]
    try:
        print("status", main(), flush=True)
    except SystemExit as exc:
        print("status", exc.code, flush=True)
    print("same handler", signal.getsignal(signal.SIGINT) is before, flush=True)
try:
    ctrl_c()
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
if {own_handler!r}:
    atexit.register(ctrl_c)
print("still running", flush=True)
"""


@pytest.mark.parametrize("own_handler", [False, True])
def test_main_puts_back_the_callers_sigint_handler(tmp_path: Path, own_handler: bool) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    argv = ["replay", str(trace), "--quiet", "--block-size", "20"]
    code = EMBEDDER.format(argv=argv, own_handler=own_handler)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    starts = ("status", "same", "handled", "Key")  # not the command's own output
    reports = [line for line in done.stdout.splitlines() if line.startswith(starts)]
    ctrl_c = ["handled"] if own_handler else ["KeyboardInterrupt"]
    at_exit = ["handled"] if own_handler else []
    runs = ["status 0", "same handler True", "status 2", "same handler True"]
    assert reports == [*runs, *ctrl_c, *at_exit]
    assert "still running" in done.stdout
    # The program's own handler also answers a Ctrl-C as the interpreter exits.
    assert done.stdout.endswith("still running\nhandled\n" if own_handler else "still running\n")
    assert done.returncode == 0, done.stderr
