"""The `kvtier` command: `kvtier demo`, `kvtier replay`."""

from __future__ import annotations

import os  # os and sys: loaded with the interpreter
import sys

# The `kvtier` script imports this module before `main` runs, where a Ctrl-C is a
# KeyboardInterrupt traceback: the command's own imports (argparse, the subcommands;
# ~0.1 s) are made inside `main`, where Ctrl-C ends the command with one line. (Even
# `typing` takes ~10 ms: type checkers know this name without it.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

# The status of a command whose reader went away (`kvtier replay t.jsonl | head -1`): what
# a shell reports for a process killed by SIGPIPE, 128 + 13.
BROKEN_PIPE_STATUS = 141
# The status of a command stopped with Ctrl-C: what a shell reports for SIGINT, 128 + 2.
INTERRUPTED_STATUS = 130


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of every subcommand."""
    import argparse

    from kvtier import __version__
    from kvtier.cli import demo_options
    from kvtier.replay import cli as replay_cli

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
    that were meant; the subcommand's usage does.
    """
    args, unknown = parser.parse_known_args(argv)
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
    """
    try:
        return _run_command(argv)
    except KeyboardInterrupt:  # before the command began: nothing to clean up
        print("\nkvtier: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    finally:
        if argv is None:  # this process is the command (the `kvtier` script, `python -m`)
            try:  # a Ctrl-C as the interpreter exits (a second one) ends it: no traceback
                _signals_end_the_process()
            except KeyboardInterrupt:  # one that came as the call began ends it too
                _signals_end_the_process(interrupted=True)
            except SystemExit:
                _signals_end_the_process()


def _signals_end_the_process(interrupted: bool = False) -> None:
    from kvtier.replay.signals import signals_end_the_process

    signals_end_the_process(interrupted)


def _run_command(argv: Sequence[str] | None) -> int:
    """Parse `argv` and run its command (see `main`)."""
    import logging

    from kvtier.replay.signals import raise_if_terminated, sigterm_unwinds

    args = parse_arguments(build_parser(), argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        with sigterm_unwinds():
            status: int = args.run(args)
            raise_if_terminated()  # it arrived where its raise was swallowed
        if sys.stdout is not None:  # None: closed when the command started (`>&-`)
            sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit
    except BrokenPipeError:
        _discard_stdout()
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:  # temporary folders and engines were closed on the way out
        print(f"\nkvtier {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return status


def _discard_stdout() -> None:
    """Point stdout's file descriptor at os.devnull.

    Output still buffered in sys.stdout is then flushed there when the interpreter exits,
    instead of raising BrokenPipeError a second time.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
