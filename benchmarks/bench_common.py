"""Helpers shared by the benchmark scripts: option types, the parser, JSON output.

Every option value is checked when it is parsed: a bad one ends the script at once with
argparse's one-line error naming the option (status 2), not a traceback, and an output
path is tried before the minutes of measuring, not after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.replay.outputs import check_creates_files, nearest_existing


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's lines and paragraphs as written; append `(default: X)` to
    each option's help that has a default worth stating."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or any(default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        if isinstance(default, list | tuple):  # as it is typed: `--a 1 2` or `--a 1,2`
            default = (" " if action.nargs in ("+", "*") else ",").join(map(str, default))
        return f"{text} (default: {default})".lstrip()


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """Return a benchmark's parser: its whole docstring (what it measures and how to read
    the numbers) as --help's description, option defaults in each option's help."""
    description = doc.strip() if doc else None
    return argparse.ArgumentParser(description=description, formatter_class=_DefaultsFormatter)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """An argparse type: a comma list of whole numbers >= 1 (`64,256,1024`)."""
    return [positive_int(part) for part in text.split(",")]


def output_range(text: str) -> tuple[int, int]:
    """An argparse type: `MIN,MAX` output tokens, 1 <= MIN <= MAX."""
    parts = positive_int_list(text)
    if len(parts) != 2 or parts[0] > parts[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def existing_file(text: str) -> Path:
    """An argparse type: a file that can be read."""
    path = Path(text)
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {state}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be read")
    return path


def existing_dir(text: str) -> Path:
    """An argparse type: a folder files can be made in."""
    path = Path(text)
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {state}")
    try:  # creates and removes a probe file: permissions alone miss /proc for root
        check_creates_files(text, path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def output_dir(text: str) -> Path:
    """An argparse type: a folder that exists, or that mkdir(parents=True) can make."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    path = Path(text)
    existing = nearest_existing(path)
    if existing == path and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    existing_dir(str(existing))
    return path


def output_file(text: str) -> Path:
    """An argparse type: a file path whose folder exists and can hold it."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    existing_dir(str(path.parent))
    return path


def add_copy_threads(parser: argparse.ArgumentParser) -> None:
    """Add `--copy-threads`, the worker's `WorkerConfig.copy_threads` (None: its choice)."""
    parser.add_argument(
        "--copy-threads",
        type=positive_int,
        help="WorkerConfig.copy_threads (default: the worker's own choice)",
    )


def write_json(
    path: str | Path, machine: Any, args: argparse.Namespace, summary: Any, rows: list[Any]
) -> None:
    """Write a benchmark's machine, arguments, summary ratios and rows (dataclasses) as JSON."""
    record = {"machine": machine, "args": vars(args), "summary": summary}
    record["rows"] = [asdict(row) for row in rows]
    with open(path, "w", encoding="utf-8") as out:
        json.dump(record, out, indent=2, default=str)


def machine_info() -> dict[str, Any]:
    """Return what a benchmark's JSON records about the machine it ran on."""
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
