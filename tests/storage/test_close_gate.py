"""The close handshake: one thread runs the close, every other caller waits for it."""

from __future__ import annotations

import threading

import pytest
from storage_helpers import WAIT_S, join_all, start_until_parked

from kvtier.storage.close_gate import CloseGate

pytestmark = pytest.mark.timeout(60)


def test_a_caller_waits_for_the_close_running_in_another_thread() -> None:
    """A second caller returns only once the first caller's action completed, and the
    action runs once."""
    gate = CloseGate()
    release = threading.Event()
    runs: list[str] = []
    seen: dict[str, list[str]] = {}

    def action() -> None:
        assert release.wait(WAIT_S)
        runs.append("closed")

    def close(name: str) -> None:
        gate.run(action)
        seen[name] = list(runs)

    first = start_until_parked(lambda: close("first"), "first")
    assert gate.is_closing
    assert not gate.is_closed
    second = start_until_parked(lambda: close("second"), "second")
    assert "second" not in seen
    release.set()
    join_all(first, second)
    assert seen == {"first": ["closed"], "second": ["closed"]}
    assert gate.is_closed
    gate.run(action)
    assert runs == ["closed"]


def test_an_action_that_raises_is_run_again_by_the_next_caller() -> None:
    """The error goes to the caller whose action raised; the gate stays closing (new work
    refused) and the next call runs the action again."""
    gate = CloseGate()
    outcomes = iter([OSError("sync failed"), None])

    def action() -> None:
        error = next(outcomes)
        if error is not None:
            raise error

    with pytest.raises(OSError, match="sync failed"):
        gate.run(action)
    assert gate.is_closing
    assert not gate.is_closed
    gate.run(action)
    assert gate.is_closed


def test_a_call_from_the_running_thread_returns_at_once() -> None:
    """A close re-entered by the thread running it (a finalizer run by a garbage
    collection inside the action) returns instead of waiting for itself."""
    gate = CloseGate()
    calls: list[str] = []

    def action() -> None:
        calls.append("outer")
        gate.run(lambda: calls.append("inner"))
        calls.append("outer done")

    gate.run(action)
    assert calls == ["outer", "outer done"]
    assert gate.is_closed


def test_mark_closing_refuses_new_work_before_the_close_runs() -> None:
    """A close handed to another thread (the disk tier's I/O thread cannot close its own
    tier) refuses new work from the moment it is asked for, not once that thread runs."""
    gate = CloseGate()
    gate.mark_closing()
    assert gate.is_closing
    assert not gate.is_closed
    with gate.working() as is_open:
        assert not is_open
    gate.run(lambda: None)
    assert gate.is_closed


def test_a_close_inside_its_own_threads_work_does_not_wait_for_it() -> None:
    """A close run by a thread that is inside `working()` itself (a finalizer run by a
    garbage collection during a forget) waits only for other threads' work: waiting for
    its own would wait forever."""
    gate = CloseGate()
    calls: list[str] = []

    def work_then_close() -> None:
        with gate.working() as is_open:
            assert is_open
            gate.run(lambda: calls.append("closed"))
            calls.append("work done")

    thread = threading.Thread(target=work_then_close, name="worker", daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the close waited for its own thread's work"
    assert calls == ["closed", "work done"]
    assert gate.is_closed
