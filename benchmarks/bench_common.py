"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any


def write_json(
    path: str, machine: Any, args: argparse.Namespace, summary: Any, rows: list[Any]
) -> None:
    """Write a benchmark's machine, arguments, summary ratios and rows (dataclasses) as JSON."""
    record = {"machine": machine, "args": vars(args), "summary": summary}
    record["rows"] = [asdict(row) for row in rows]
    with open(path, "w", encoding="utf-8") as out:
        json.dump(record, out, indent=2, default=str)
