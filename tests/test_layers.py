"""Import direction between kvtier's layers, and the line budget (STYLE.md, ARCHITECTURE.md).

Rules the checker enforces, from parsing every module of src/kvtier (nothing is imported):

- `kvtier.core` and `kvtier.offload` never import torch, anywhere in the file (also
  inside functions and under `if TYPE_CHECKING:`). numpy is a declared dependency and is
  allowed; only torch is forbidden.
- Imports point down the layers core=0 < offload=1 < transfer=storage=2 <
  engine=adapters=replay=3 < cli=4: a module never imports a higher layer.
- Within one layer: transfer <-> storage is allowed (the disk tier and the copier share
  worker-side code); engine, adapters and replay are independent consumers of the library
  and never import each other.
- The top-level `kvtier/__init__.py` is the public facade: it may import any layer
  (lazily), but not torch at module level. Because it sits above everything, a layered
  module must not import from it (only `kvtier.__version__` is allowed).
- A subpackage missing from `LAYERS` is reported, so a new one must be placed explicitly.

Imports counted: `import x`, `from x import y` (recorded as `x.y`, so `from kvtier import
engine` is seen), relative imports resolved to absolute names, imports nested in
functions, classes or `if` blocks, and `importlib.import_module("x")` / `__import__("x")`
with a literal name.
"""

from __future__ import annotations

import ast
import runpy
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "kvtier"
LINE_BUDGET_SCRIPT = ROOT / "scripts" / "check_line_budget.py"

LAYERS = {
    "core": 0,
    "offload": 1,
    "transfer": 2,
    "storage": 2,
    "engine": 3,
    "adapters": 3,
    "replay": 3,
    "cli": 4,
    "__main__": 5,  # `python -m kvtier`: runs the cli
}
NO_TORCH = frozenset({"core", "offload"})
SAME_LAYER_ALLOWED = frozenset({frozenset({"transfer", "storage"})})
FACADE_NAMES_ALLOWED = frozenset({"kvtier.__version__"})
TYPE_CHECKING_TORCH = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"


class Import(NamedTuple):
    name: str  # absolute dotted name
    line: int
    at_import_time: bool  # runs when the module is imported (not in a def, not TYPE_CHECKING)


def resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """Return the absolute name of `from <level dots><target> import ...` inside `module`."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        raise ValueError(f"relative import beyond the top package in {module}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.Call) -> str | None:
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def collect_imports(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Return every import in `source`, the code of `module`, with absolute names."""
    found: list[Import] = []

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, at_import_time) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = resolve_relative(module, is_package, node.level, node.module)
            for alias in node.names:
                name = base if alias.name == "*" else f"{base}.{alias.name}"
                found.append(Import(name, node.lineno, at_import_time))
        elif isinstance(node, ast.Call) and (name := _dynamic_import(node)):
            found.append(Import(name, node.lineno, at_import_time))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import_time)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time)

    visit(ast.parse(source), True)
    return found


def subpackage(name: str) -> str | None:
    """Return the kvtier subpackage a dotted name belongs to; "" for the facade itself."""
    parts = name.split(".")
    if parts[0] != "kvtier":
        return None
    if len(parts) == 1 or not _is_subpackage_name(parts[1]):
        return ""
    return parts[1]


def _is_subpackage_name(part: str) -> bool:
    return part in LAYERS or (PACKAGE_DIR / part).is_dir() or (PACKAGE_DIR / f"{part}.py").exists()


def check_source(source: str, module: str, is_package: bool = False) -> list[str]:
    """Return one message per import of `module` that breaks a layer rule."""
    parts = module.split(".")
    if parts[0] != "kvtier":
        raise ValueError(f"{module} is not a kvtier module")
    own = parts[1] if len(parts) > 1 else ""  # "" for the facade, kvtier/__init__.py
    if own and own not in LAYERS:
        return [f"{module}: subpackage {own!r} has no layer in LAYERS"]
    problems = []
    for imp in collect_imports(source, module, is_package):
        where = f"{module}:{imp.line} imports {imp.name}"
        if imp.name.split(".")[0] == "torch":
            if own in NO_TORCH:
                problems.append(f"{where}: {own} must not import torch")
            elif own == "" and imp.at_import_time:
                problems.append(f"{where}: the top-level package imports torch eagerly")
            continue
        target = subpackage(imp.name)
        if target is None or target == own or own == "":
            continue
        if target == "":
            if imp.name not in FACADE_NAMES_ALLOWED:
                problems.append(f"{where}: layered modules must not import the facade")
        elif target not in LAYERS:
            problems.append(f"{where}: subpackage {target!r} has no layer in LAYERS")
        elif LAYERS[target] > LAYERS[own]:
            problems.append(f"{where}: {own} (layer {LAYERS[own]}) is below {target}")
        elif LAYERS[target] == LAYERS[own] and frozenset({own, target}) not in SAME_LAYER_ALLOWED:
            problems.append(f"{where}: {own} and {target} must not import each other")
    return problems


def module_name(path: Path) -> tuple[str, bool]:
    """Return the dotted module name of a file under src/kvtier and whether it is a package."""
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    is_package = rel.name == "__init__"
    parts = rel.parts[:-1] if is_package else rel.parts
    return ".".join(parts), is_package


def check_tree() -> tuple[list[str], list[str]]:
    """Return (modules scanned, problems) for every .py file of src/kvtier."""
    modules, problems = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module, is_package = module_name(path)
        modules.append(module)
        problems += check_source(path.read_text(encoding="utf-8"), module, is_package)
    return modules, problems


# --- the real tree ------------------------------------------------------------------


def test_source_tree_respects_layers() -> None:
    """No module of src/kvtier breaks a layer or torch rule (see the module docstring)."""
    modules, problems = check_tree()
    assert {"kvtier", "kvtier.core.longest_hit", "kvtier.offload"} <= set(modules)
    assert problems == [], "\n".join(problems)


# --- the checker itself -------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "is_package", "level", "target", "expected"),
    [
        ("kvtier.core.keys", False, 1, "kv_groups", "kvtier.core.kv_groups"),
        ("kvtier.core.keys", False, 2, "offload.plan", "kvtier.offload.plan"),
        ("kvtier.core.keys", False, 2, None, "kvtier"),
        ("kvtier.core", True, 1, "keys", "kvtier.core.keys"),
        ("kvtier.core", True, 2, "engine", "kvtier.engine"),
        ("kvtier.adapters.vllm.connector", False, 3, "core", "kvtier.core"),
    ],
)
def test_relative_imports_resolve_to_absolute(
    module: str, is_package: bool, level: int, target: str | None, expected: str
) -> None:
    """Relative imports resolve against the module's package (a package is its own)."""
    assert resolve_relative(module, is_package, level, target) == expected


def test_collect_imports_finds_nested_and_dynamic_imports() -> None:
    """Imports inside functions, `from` imports and import_module calls are all collected."""
    source = (
        "import os, json as j\n"
        "from . import keys\n"
        "from ..offload.plan import TransferPlan\n"
        "def f():\n"
        "    import torch\n"
        "    return importlib.import_module('kvtier.cli')\n"
    )
    assert collect_imports(source, "kvtier.core.x") == [
        Import("os", 1, True),
        Import("json", 1, True),
        Import("kvtier.core.keys", 2, True),
        Import("kvtier.offload.plan.TransferPlan", 3, True),
        Import("torch", 5, False),
        Import("kvtier.cli", 6, False),
    ]


@pytest.mark.parametrize(
    ("module", "source", "reason"),
    [
        ("kvtier.core.x", "import torch\n", "core must not import torch"),
        ("kvtier.core.x", "def f():\n    import torch.nn\n", "core must not import torch"),
        ("kvtier.offload.x", "from torch import nn\n", "offload must not import torch"),
        ("kvtier.offload.x", TYPE_CHECKING_TORCH, "offload must not import torch"),
        ("kvtier.core.x", "from ..offload import plan\n", "core (layer 0) is below offload"),
        ("kvtier.core.x", "from .. import engine\n", "core (layer 0) is below engine"),
        ("kvtier.offload.x", "import kvtier.transfer.worker\n", "below transfer"),
        ("kvtier.storage.x", "def f():\n    from kvtier.engine import LLM\n", "below engine"),
        ("kvtier.engine.x", "from kvtier.cli.main import main\n", "below cli"),
        ("kvtier.engine.x", "from kvtier.adapters import vllm\n", "engine and adapters"),
        ("kvtier.replay.x", "from ..engine import LLM\n", "replay and engine"),
        ("kvtier.adapters", "from kvtier.replay import trace\n", "adapters and replay"),
        ("kvtier.core.x", "from kvtier import LLM\n", "must not import the facade"),
        ("kvtier.core.x", "import kvtier.newthing\n", "must not import the facade"),
        ("kvtier.newthing.x", "import os\n", "'newthing' has no layer"),
        ("kvtier", "import torch\n", "imports torch eagerly"),
    ],
)
def test_checker_reports_bad_imports(module: str, source: str, reason: str) -> None:
    """Each synthetic bad import is reported once, with its reason (so the tree test can fail)."""
    problems = check_source(source, module, is_package=not module.endswith(".x"))
    assert len(problems) == 1
    assert reason in problems[0]


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("kvtier.core.x", "import numpy as np\nfrom kvtier.core.keys import make_key\n"),
        ("kvtier.offload.x", "from ..core import block_pool\n"),
        ("kvtier.transfer.x", "import torch\nfrom kvtier.storage.disk import DiskTier\n"),
        ("kvtier.storage.x", "from ..transfer.regions import Region\n"),
        ("kvtier.engine.x", "import torch\nfrom kvtier.offload.scheduler import S\n"),
        ("kvtier.cli.x", "from kvtier.engine import LLM\nfrom kvtier.replay import run\n"),
        ("kvtier.cli.x", "from kvtier import __version__\n"),
        ("kvtier", "def __getattr__(name):\n    import torch\n    from .engine import LLM\n"),
        ("kvtier", TYPE_CHECKING_TORCH),
    ],
)
def test_checker_accepts_good_imports(module: str, source: str) -> None:
    """Downward imports, numpy in core, transfer <-> storage and lazy facade imports pass."""
    assert check_source(source, module, is_package=not module.endswith(".x")) == []


# --- line budget --------------------------------------------------------------------


@pytest.mark.parametrize(("num_lines", "expected"), [(600, 0), (601, 1)])
def test_line_budget_script_fails_past_600_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], num_lines: int, expected: int
) -> None:
    """scripts/check_line_budget.py returns 1 and names a 601-line file, 0 for 600 lines."""
    main = runpy.run_path(str(LINE_BUDGET_SCRIPT), run_name="line_budget")["main"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * num_lines, encoding="utf-8")
    (tmp_path / "small.py").write_text("y = 2\n", encoding="utf-8")
    assert main([str(tmp_path)]) == expected
    assert ("big.py: 601 lines" in capsys.readouterr().out) is bool(expected)
