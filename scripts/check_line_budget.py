"""Fail when any Python source file is longer than the line budget (600 lines)."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 600


def main(roots: list[str]) -> int:
    """Print every file over budget and return 1 if there is one."""
    over = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            num_lines = len(path.read_text(encoding="utf-8").splitlines())
            if num_lines > MAX_LINES:
                over.append((path, num_lines))
    for path, num_lines in over:
        print(f"{path}: {num_lines} lines (budget {MAX_LINES})")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["src"]))
