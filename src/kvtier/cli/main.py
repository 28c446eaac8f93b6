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

    The SIGINT and SIGTERM handlers in place when `main` was called are back in place
    when it returns: a program that imports kvtier and calls `main` keeps its Ctrl-C.
    Without `argv` (the `kvtier` script, `python -m`), a Ctrl-C once the interpreter
    begins to exit (joining threads, atexit callbacks) ends the process as the shell
    expects, instead of a KeyboardInterrupt traceback (`signals_end_the_process`).
    """
    return run_command(argv, ends_the_process=argv is None)


def run_command(argv: Sequence[str] | None, ends_the_process: bool) -> int:
    """`main`, for any entry point: `python -m kvtier.replay` runs `kvtier replay` here.

    `argv` None: `sys.argv[1:]`. `ends_the_process`: this process exits after the
    command (see `main`).
    """
    previous: dict[int, object] = {}
    try:
        try:
            previous = _signal_handlers()  # its imports (signal, threading) take ms
            return _run_command(argv)
        finally:
            _restore_signal_handlers(previous)  # a Ctrl-C pending meanwhile is raised here
    except KeyboardInterrupt:  # before the command began, or as it ended: nothing to clean up
        print("\nkvtier: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    finally:
        if ends_the_process:
            _signals_end_the_process_at_exit()


def _signal_handlers() -> dict[int, object]:
    """Return SIGINT's and SIGTERM's handlers as `main` is called (none outside the main
    thread, where none can be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    return {signum: h for signum, h in handlers.items() if h is not None}  # None: set in C


def _restore_signal_handlers(previous: dict[int, object]) -> None:
    """Put back the handlers `_signal_handlers` returned (the command wraps them in
    `signals_deferred`'s); a Ctrl-C run as they change is raised once all are back."""
    import signal

    interrupted = False
    for signum, handler in previous.items():
        while True:
            try:  # a pending signal runs the handler in place before the swap: swap again
                signal.signal(signum, handler)  # type: ignore[arg-type]
                break
            except KeyboardInterrupt:
                interrupted = True
    if interrupted:
        raise KeyboardInterrupt


def _signals_end_the_process_at_exit() -> None:
    try:  # its module is imported here when a Ctrl-C came before the command imported it
        from kvtier.replay.signals import end_the_process_at_exit

        end_the_process_at_exit()
    except KeyboardInterrupt:  # one as the command ended (a second one): it ends the process
        from kvtier.replay.signals import signals_end_the_process

        signals_end_the_process(interrupted=True)


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
