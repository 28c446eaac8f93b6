"""Ctrl-C while `kvtier` starts: one line and status 130, never a traceback or a lost signal.

Regressions: a Ctrl-C while the `kvtier` script imported `kvtier.cli.main` (which
imported every subcommand, ~0.1 s) printed a KeyboardInterrupt traceback; one while the
demo imported torch was swallowed by torch (it catches any error while it imports numpy),
and the demo ran on to its end with numpy half imported and exited 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

# A finder first on sys.meta_path: Ctrl-C arrives as `{module}` starts to be imported.
# With `swallow`, the KeyboardInterrupt raised there is caught and dropped, as torch's
# C++ does for any exception raised while it imports numpy.
CTRL_C_WHILE_IMPORTING = """
import signal, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} and self in sys.meta_path:
            sys.meta_path.remove(self)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                if not {swallow!r}:
                    raise
        return None

sys.meta_path.insert(0, CtrlC())
from kvtier.cli.main import main
sys.exit(main({argv!r}))
"""
SMALL_DEMO = [
    "--conversations",
    "2",
    "--turns",
    "2",
    "--system-tokens",
    "16",
    "--document-tokens",
    "16",
    "--user-tokens",
    "8",
    "--answer-tokens",
    "2",
    "--gpu-blocks",
    "16",
    "--cpu-mib",
    "1",
    "--disk-mib",
    "1",
    "--cascade-cpu-mib",
    "1",
]


def _run(module: str, swallow: bool, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = CTRL_C_WHILE_IMPORTING.format(module=module, swallow=swallow, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _replay_one_request(tmp_path: Path, module: str) -> subprocess.CompletedProcess[str]:
    """`kvtier replay --quiet` of a one-request trace, a Ctrl-C as `module` is imported."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    return _run(module, False, ["replay", str(trace), "--quiet"])


def test_ctrl_c_while_the_command_is_imported_is_one_line(tmp_path: Path) -> None:
    done = _replay_one_request(tmp_path, "kvtier.replay.cli")
    assert "Traceback" not in done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stderr == "\nkvtier: interrupted\n"
    assert done.stdout == ""


def test_ctrl_c_that_torch_swallows_still_stops_the_demo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["demo", *SMALL_DEMO, "--out", str(out), "--disk-dir", str(tmp_path)]
    done = _run("torch", True, argv)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.endswith("\nkvtier demo: interrupted\n")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # nothing was served
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_as_main_reads_the_signal_handlers_is_one_line(tmp_path: Path) -> None:
    # Regression: `main` read the handlers to put back (importing `threading`, and
    # `signal` in the `kvtier` script: ms) before its Ctrl-C handling began: a traceback.
    done = _replay_one_request(tmp_path, "threading")
    assert "Traceback" not in done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stderr == "\nkvtier: interrupted\n"


# The `kvtier` script (`main()`): a Ctrl-C as each of `modules` starts to be imported.
CTRL_C_TWICE = """
import signal, sys

class CtrlC:
    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module and self in sys.meta_path:
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None

for module in {modules!r}:
    sys.meta_path.insert(0, CtrlC(module))
from kvtier.cli.main import main
sys.argv = ["kvtier", "replay", "--help"]
sys.exit(main())
"""


def test_a_second_ctrl_c_as_the_script_ends_ends_it_without_a_traceback() -> None:
    # Regression: the first Ctrl-C came before the command imported kvtier.replay.signals,
    # so `main` imported it as it ended, outside its Ctrl-C handling: a second Ctrl-C
    # there printed a KeyboardInterrupt traceback.
    code = CTRL_C_TWICE.format(modules=["logging", "kvtier.replay.signals"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr
    assert done.stderr == "\nkvtier: interrupted\n"
    assert done.returncode == -signal.SIGINT  # ended by the second one, as the shell expects
