"""docs/ARCHITECTURE.md names every module of kvtier ("one line per module").

Regression: offload/partial_states.py (d7717ce) was missing from the table.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "kvtier"


def listed_modules(doc: str) -> tuple[set[str], set[str]]:
    """Return the module paths the table's first column names, and the folders it covers
    whole (a `dir/` entry). A bare file name after a path is in that path's folder
    (`storage/manifest.py`, `manifest_read.py`); one before any path is top-level."""
    paths: set[str] = set()
    folders: set[str] = set()
    for line in doc.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if name.endswith("/"):
                folders.add(name)
            elif "/" in name:
                paths.add(name)
                folder = name.rsplit("/", 1)[0] + "/"
            else:
                paths.add(folder + name)
    return paths, folders


def test_listed_modules_reads_the_tables_conventions() -> None:
    doc = (
        "| `__main__.py`, `cli/main.py`, `demo.py` | x |\n"
        "| `replay/` | `kvtier replay`: `gpu_tier.py` |\n"
        "| `storage/a.py`, `b.py`, `core/c.py` | y |\n"
    )
    paths, folders = listed_modules(doc)
    assert paths == {"__main__.py", "cli/main.py", "cli/demo.py", "storage/a.py",
                     "storage/b.py", "core/c.py"}  # fmt: skip
    assert folders == {"replay/"}


def test_every_module_is_in_the_architecture_table() -> None:
    paths, folders = listed_modules((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    missing = sorted(
        module
        for module in modules - paths
        if not any(module.startswith(folder) for folder in folders)
    )
    assert missing == [], f"docs/ARCHITECTURE.md has no row for {missing}"
    gone = sorted(paths - modules)
    assert gone == [], f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"
