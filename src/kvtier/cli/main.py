"""The `kvtier` command: `kvtier demo`, `kvtier replay`, `kvtier generate`."""

from __future__ import annotations

import sys  # loaded with the interpreter

# Its path for every command; it imports only os and sys, as this module: the `kvtier`
# script imports this module before `main` runs, where a Ctrl-C is a KeyboardInterrupt
# traceback. The command's own imports (argparse, the subcommands; ~0.1 s) are made
# inside `main`, where Ctrl-C ends the command with one line. (Even `typing` takes
# ~10 ms: type checkers know these names without it.)
from kvtier.replay.command import BROKEN_PIPE_STATUS, INTERRUPTED_STATUS, run_command

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

__all__ = [
    "BROKEN_PIPE_STATUS",
    "INTERRUPTED_STATUS",
    "build_parser",
    "main",
    "parse_arguments",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of every subcommand."""
    import argparse

    from kvtier import __version__
    from kvtier.cli import demo_options
    from kvtier.replay import cli as replay_cli
    from kvtier.replay import generate

    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a hierarchical KV cache (GPU -> host memory -> disk) for LLM engines.",
    )
    verbose_help = "log at INFO level (default: WARNING)"
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_options.add_parser(subparsers)
    replay_cli.add_parser(subparsers)
    generate.add_parser(subparsers)
    for command in subparsers.choices.values():  # `kvtier demo -v` as `kvtier -v demo`
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help
        )
        command.set_defaults(command_parser=command)  # its usage for its unknown options
    return parser


def parse_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """Parse `argv`; an unknown option is reported by the subcommand it was given to.

    argparse leaves options a subcommand does not know to the top-level parser, whose
    usage line (`kvtier [-h] [-v] [--version] COMMAND ...`) does not show the options
    that were meant; the subcommand's usage does. A value like `-1M` is checked by its
    option's type, not taken for an option (`attach_dashed_values`).
    """
    from kvtier.replay.option_types import attach_dashed_values

    args, unknown = parser.parse_known_args(
        attach_dashed_values(sys.argv[1:] if argv is None else argv)
    )
    if unknown:
        command: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvtier` command line; return the exit status.

    Output piped into a reader that stops early (`| head -1`) ends the command quietly
    with BROKEN_PIPE_STATUS instead of a BrokenPipeError traceback; Ctrl-C ends it with
    one line and INTERRUPTED_STATUS instead of a KeyboardInterrupt traceback, also while
    the command's modules are imported and its options parsed. SIGTERM ends it with
    TERMINATED_STATUS (`kvtier.replay.signals`) once the command has cleaned up (the
    demo's disk tier folder is removed), instead of killing it on the spot.

    The SIGINT and SIGTERM handlers in place when `main` was called are back in place
    when it returns: a program that imports kvtier and calls `main` keeps its Ctrl-C.
    Without `argv` (the `kvtier` script, `python -m`), a Ctrl-C once the interpreter
    begins to exit (joining threads, atexit callbacks) ends the process as the shell
    expects, instead of a KeyboardInterrupt traceback (`signals_end_the_process`).
    """
    return run_command(argv, ends_the_process=argv is None, parse=_parse)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Return the arguments of `argv` (None: `sys.argv[1:]`) for the `kvtier` command."""
    return parse_arguments(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
