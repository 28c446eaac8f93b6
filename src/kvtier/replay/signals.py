"""SIGTERM and Ctrl-C in kvtier's commands (`kvtier demo`, `kvtier replay`, the trace
generator), and around the files they write.

`sigterm_unwinds` turns SIGTERM into an exception, so that `with` blocks remove their
temporary files (the default action kills the process on the spot). `signals_deferred`
holds SIGINT and SIGTERM over a few statements that must not be cut in two (a file
created and its removal registered; a set of files renamed into place), then delivers
them as their handlers would have. Its first use wraps the handlers in place for good
(`signal.getsignal` then returns the wrapper; its `inner` is the handler it wraps).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

TERMINATED_STATUS = 143  # 128 + SIGTERM: what a shell reports for `kill` and `timeout`
_HELD = (signal.SIGINT, signal.SIGTERM)


_requested = threading.Event()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Make SIGTERM (`kill`, `timeout`) raise SystemExit(TERMINATED_STATUS) inside the block.

    The exception unwinds the command wherever the main thread is, so its `with` blocks
    run and its temporary files go with it. Raised inside a finalizer or a weak
    reference's callback, the interpreter swallows it (and would print "Exception
    ignored", which the block's unraisable hook keeps quiet) and the command would run
    on: the request is remembered too, and `raise_if_terminated`, called at a command's
    safe points (after each demo turn, after the command), raises it again. Does nothing
    outside the main thread (no handler can be set there), nor inside another such block
    (`kvtier generate` under `run_command`), whose request it must not forget.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    in_place = signal.getsignal(signal.SIGTERM)
    if getattr(getattr(in_place, "inner", in_place), "unwinds", False):  # inside a block
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        _requested.set()
        raise SystemExit(TERMINATED_STATUS)

    terminate.unwinds = True  # type: ignore[attr-defined]

    previous_hook = sys.unraisablehook

    def quiet_swallowed_exit(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and _requested.is_set():
            return  # raised again by `raise_if_terminated`
        previous_hook(unraisable)

    _requested.clear()
    previous = signal.signal(signal.SIGTERM, terminate)
    sys.unraisablehook = quiet_swallowed_exit
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        sys.unraisablehook = previous_hook
        _requested.clear()  # handled: later work in this process is not stopped


def raise_if_terminated() -> None:
    """Raise SystemExit(TERMINATED_STATUS) if SIGTERM arrived inside `sigterm_unwinds`
    (its first raise may have been swallowed)."""
    if _requested.is_set():
        raise SystemExit(TERMINATED_STATUS)


def signals_end_the_process(interrupted: bool = False) -> None:
    """Give SIGINT its default action from now on if it has Python's (KeyboardInterrupt):
    for a process whose command has ended (its cleanup done) and which is exiting.

    A Ctrl-C while the interpreter then shuts down (atexit callbacks, joining threads:
    a second Ctrl-C just after the first) ends the process as the shell expects, instead
    of a KeyboardInterrupt traceback under "Exception ignored". One that was pending as
    its handler was replaced is acted on the same way, as is a Ctrl-C whose
    KeyboardInterrupt the caller caught as it called this (`interrupted`). A signal
    ignored (SIG_IGN: a script's `kvtier ... &` ignores SIGINT), or given a handler of
    the program's own (a program that ran `kvtier.cli.main.main`), is left as it is;
    SIGTERM's default action already ends the process. Python's handler wrapped by
    `signals_deferred` counts as Python's: the caller's handler may not be back (a Ctrl-C
    as `run_command` began to put it back). Does nothing outside the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    pending = [signal.SIGINT] if interrupted else []
    while _is_pythons_handler(signal.getsignal(signal.SIGINT)):
        try:  # a pending signal runs its handler before the swap, which is then undone
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            break
        except KeyboardInterrupt:
            pending.append(signal.SIGINT)
    for signum in pending:
        signal.raise_signal(signum)


def _is_pythons_handler(handler: Any) -> bool:
    """Whether `handler` raises KeyboardInterrupt: Python's own, or it wrapped by
    `signals_deferred` (outside its blocks, the wrapper does what it wraps)."""
    if isinstance(handler, _Holding):
        handler = handler.inner
    return handler is signal.default_int_handler


_at_exit = threading.Lock()
_at_exit_registered = False


def end_the_process_at_exit() -> None:
    """Call `signals_end_the_process` once the interpreter begins to exit (before it joins
    the threads left and runs the atexit callbacks), not before: until then the program
    that called keeps its SIGINT handler. Registered once per process."""
    global _at_exit_registered
    with _at_exit:
        if _at_exit_registered:
            return
        _at_exit_registered = True
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+: before the joins
    try:
        if register is not None:
            register(_end_the_process)
            return
    except RuntimeError:  # the interpreter is already exiting
        _end_the_process()
        return
    import atexit

    atexit.register(_end_the_process)


def _end_the_process() -> None:
    try:  # a Ctrl-C as the interpreter exits (a second one) ends it: no traceback
        signals_end_the_process()
    except KeyboardInterrupt:  # one that came as the call began ends it too
        signals_end_the_process(True)  # interrupted
    except SystemExit:
        signals_end_the_process()


class _Holding:
    """The SIGINT/SIGTERM handler `signals_deferred` installs around the one in place.

    Outside a `signals_deferred` block it does what `inner` does; inside one it notes
    the signal for the block's end. It is never swapped back: swapping handlers races
    with a pending signal, which Python runs at any bytecode, also inside
    `signal.signal` before the swap (two earlier designs left a handler installed that
    way). `inner` SIG_IGN is never wrapped (children inherit the ignored signal).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, signum: int, frame: object) -> None:
        if _state.depth:
            _state.arrived.append((signum, self.inner))
        else:
            _act(self.inner, signum)


class _State:
    def __init__(self) -> None:
        self.depth = 0  # nesting of `signals_deferred` blocks (main thread only)
        self.arrived: list[tuple[int, Any]] = []  # (signal, its handler) held, oldest first


_state = _State()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver each that arrived.

    For a few statements only: Ctrl-C waits for them. A signal held is delivered also
    when the block raises (its exception then gives way to the signal's, e.g. Ctrl-C's
    KeyboardInterrupt). Inside another such block it joins it; outside the main thread
    it does nothing. (Blocking the signals with `pthread_sigmask` would not do: another
    thread of the process can take them.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    for signum in _HELD:  # once per handler; a signal during this acts as it would have
        handler = signal.getsignal(signum)
        if not isinstance(handler, _Holding) and handler is not signal.SIG_IGN:
            signal.signal(signum, _Holding(handler))
    _state.depth += 1
    try:
        yield
    finally:
        try:
            if _state.depth == 1:
                _deliver_held()  # still holding: a signal meanwhile joins the queue
        finally:
            _state.depth -= 1
        if _state.depth == 0 and _state.arrived:  # one that came as the hold ended
            _deliver_held()


def _deliver_held() -> None:
    """Act on every held signal in order; raise the first exception a handler raised."""
    raised: BaseException | None = None
    while _state.arrived:
        signum, inner = _state.arrived.pop(0)
        try:
            _act(inner, signum)
        except BaseException as exc:
            raised = raised or exc
    if raised is not None:
        raise raised


def _act(handler: Any, signum: int) -> None:
    """Do what `handler` does for `signum`: call it, or take the default action."""
    if callable(handler):
        handler(signum, None)
    elif handler is signal.SIG_DFL or handler is None:  # None: set outside Python
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # for SIGINT and SIGTERM: the end of the process
