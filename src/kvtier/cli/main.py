"""The `kvtier` command: `kvtier demo`, `kvtier replay`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvtier.cli import demo
from kvtier.replay import cli as replay_cli


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a hierarchical KV cache (GPU -> host memory -> disk) for LLM engines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(subparsers)
    replay_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvtier` command line; return the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
