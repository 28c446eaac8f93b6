"""`python -m kvtier.replay` runs on the same path as `kvtier replay` (`kvtier.cli.main`).

Regression: `python -m kvtier.replay` ran `kvtier.replay.cli.main`, a second copy of the
command's start and end without `kvtier`'s handling of Ctrl-C: one while the command's
modules were imported, or one as the interpreter exited after the command, printed a
KeyboardInterrupt traceback (`kvtier replay` prints one line, or ends by the signal).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

TRACE = '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n'

# `python -m kvtier.replay ARGS`, with a Ctrl-C as `{module}` starts to be imported
# (none: no such module) and one from an atexit callback (as the interpreter exits).
MODULE_RUN = """
import atexit, os, runpy, signal, sys, time

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} and self in sys.meta_path:
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # the handler runs here

atexit.register(ctrl_c)
sys.meta_path.insert(0, CtrlC())
sys.argv = ["kvtier.replay", *{argv!r}]
runpy.run_module("kvtier.replay", run_name="__main__", alter_sys=True)
"""


def _run(tmp_path: Path, module: str) -> subprocess.CompletedProcess[str]:
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    argv = [str(trace), "--quiet", "--block-size", "20"]
    code = MODULE_RUN.format(module=module, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_ctrl_c_as_python_m_kvtier_replay_exits_is_no_traceback(tmp_path: Path) -> None:
    done = _run(tmp_path, "no.such.module")
    assert "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert done.returncode == -signal.SIGINT, done.stderr  # ended by the signal
    assert "TTFT" in done.stdout  # the command had finished


def test_ctrl_c_while_python_m_kvtier_replay_starts_is_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, "kvtier.replay.sweep")
    assert "Traceback" not in done.stderr
    assert done.stderr == "\nkvtier: interrupted\n"
    assert done.returncode == -signal.SIGINT  # 130, then the Ctrl-C at exit ends it
    assert done.stdout == ""
