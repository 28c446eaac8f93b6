"""The names `kvtier.replay` exports, imported on first use (PEP 562): each one works as
an attribute, with `from kvtier.replay import`, in `dir()`, and to type checkers.

Regression: with the package's `__getattr__` visible to type checkers, mypy typed any
attribute of the package as `object`, so a misspelt name was no error; `dir()` left out
the names not used yet.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
import kvtier.replay

SRC = Path(kvtier.__file__).resolve().parents[1]


def test_every_exported_name_is_its_home_modules_object() -> None:
    for name in kvtier.replay.__all__:
        home = importlib.import_module(f"kvtier.replay.{kvtier.replay._HOME[name]}")
        assert getattr(kvtier.replay, name) is getattr(home, name)
        namespace: dict[str, object] = {}
        exec(f"from kvtier.replay import {name}", namespace)
        assert namespace[name] is getattr(home, name)
    with pytest.raises(AttributeError, match="no attribute 'ReplayConfg'"):
        kvtier.replay.ReplayConfg  # noqa: B018


def test_the_package_alone_imports_no_submodule_and_lists_every_name() -> None:
    code = (
        "import sys, kvtier.replay as r\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvtier.replay.')))\n"
        "print(sorted(set(r.__all__) - set(dir(r))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n[]\n"


def test_a_misspelt_name_is_a_type_error(monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")
    monkeypatch.setenv("MYPYPATH", str(SRC))
    program = "import kvtier.replay as r\nr.ReplayConfg\nfrom kvtier.replay import TierReplay\n"
    options = ["--config-file=", "--no-incremental", "--cache-dir=/dev/null"]
    options += ["--follow-imports=silent", "--ignore-missing-imports"]
    out, err, status = api.run([*options, "-c", program])
    assert status == 1, out + err
    assert 'Module has no attribute "ReplayConfg"' in out
    assert "TierReplay" not in out  # the real names are known
