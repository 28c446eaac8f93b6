"""The `VllmHarness`es built and not yet closed, for conftest.py to close at each test's
teardown (test helper only; no vLLM import, so the conftest loads without vLLM).

A harness's workers hold transfer threads, host memory and disk files, and the harness
sits in reference cycles: left to the garbage collector, they were released whenever a
collection happened to run, possibly inside a later test ("dropped without shutdown()").
"""

from __future__ import annotations

from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


OPEN: list[Closable] = []


def close_opened_since(before: list[Closable]) -> None:
    """Close every harness opened since `before` (a copy of `OPEN`), newest first; one
    whose close raised is still dropped from `OPEN`, and the first error is re-raised
    once all were closed."""
    opened = [h for h in OPEN if not any(h is b for b in before)]
    errors: list[Exception] = []
    for harness in reversed(opened):
        try:
            harness.close()
        except Exception as exc:  # close the others, then report the first
            errors.append(exc)
        finally:
            forget(harness)
    if errors:
        raise errors[0]


def forget(harness: Closable) -> None:
    """Drop `harness` from `OPEN` (closed, or its close failed)."""
    OPEN[:] = [h for h in OPEN if h is not harness]
