"""The path every kvtier command runs on (`kvtier demo`, `kvtier replay`, `python -m
kvtier.replay`): its exit statuses, its handling of Ctrl-C, SIGTERM and a reader that
went away, and the caller's signal handlers put back on return (`run_command`).

Here, below `kvtier.cli`, so that `python -m kvtier.replay` runs on it too without the
replay layer importing the command line's (`kvtier.cli.main` passes its own parser).
Only os and sys (loaded with the interpreter) are imported with this module: a Ctrl-C
while the command's own modules are imported is one line, not a traceback.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

# The status of a command whose reader went away (`kvtier replay t.jsonl | head -1`): what
# a shell reports for a process killed by SIGPIPE, 128 + 13.
BROKEN_PIPE_STATUS = 141
# The status of a command stopped with Ctrl-C: what a shell reports for SIGINT, 128 + 2.
INTERRUPTED_STATUS = 130


def run_command(
    argv: Sequence[str] | None,
    *,
    ends_the_process: bool,
    parse: Callable[[Sequence[str] | None], argparse.Namespace],
) -> int:
    """Parse `argv` (None: `sys.argv[1:]`) with `parse` and run the command it names
    (`args.run`); return the exit status (see `kvtier.cli.main.main`).

    `parse` imports what it needs: it runs where a Ctrl-C is one line. The namespace
    gives `command` (its name in messages), `verbose` and `run`. `ends_the_process`: this
    process exits after the command (a Ctrl-C as it exits then ends it by the signal).
    """
    previous: dict[int, object] = {}
    try:
        try:
            previous = _signal_handlers()  # its imports (signal, threading) take ms
            return _run_command(argv, parse)
        finally:
            _restore_signal_handlers(previous)  # a Ctrl-C pending meanwhile is raised here
    except KeyboardInterrupt:  # before the command began, or as it ended: nothing to clean up
        print("\nkvtier: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    finally:
        if ends_the_process:
            _signals_end_the_process_at_exit()


def _signal_handlers() -> dict[int, object]:
    """Return SIGINT's and SIGTERM's handlers as `run_command` is called (none outside
    the main thread, where none can be set)."""
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


def _run_command(
    argv: Sequence[str] | None, parse: Callable[[Sequence[str] | None], argparse.Namespace]
) -> int:
    """Parse `argv` with `parse` and run its command (see `run_command`)."""
    import logging

    from kvtier.replay.signals import raise_if_terminated, sigterm_unwinds

    args = parse(argv)
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
    except KeyboardInterrupt as interrupt:  # temporary folders and engines were closed
        print(f"\nkvtier {args.command}: interrupted", file=sys.stderr)
        _drop_held_frames(interrupt)
        return INTERRUPTED_STATUS
    return status


def _drop_held_frames(interrupt: BaseException) -> None:
    """Free what the interrupted command's frames held (the demo's engine and tiers) while
    Ctrl-C waits, then deliver one that came meanwhile (KeyboardInterrupt, one line).

    Their finalizers run as the frames go; a Ctrl-C (a second one) that Python ran inside
    one was swallowed with an "Exception ignored in: <finalize object>" traceback.
    """
    import gc

    from kvtier.replay.signals import signals_deferred

    with signals_deferred():
        seen: set[int] = set()
        exc: BaseException | None = interrupt
        while exc is not None and id(exc) not in seen:  # the chain it was raised in
            seen.add(id(exc))
            exc.__traceback__ = None
            exc = exc.__context__
        gc.collect()  # frames in cycles (a torch module's) too


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
