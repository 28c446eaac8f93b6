"""Catch offload workers a test leaves to the garbage collector (test helper only).

A worker dropped without `shutdown()` is released by its finalizer whenever a collection
runs (`kvtier.transfer.worker_resources.release_dropped`, which logs "dropped without
shutdown()"): possibly inside a later test, on any thread. `DropRecorder` records those
log lines while a test runs; conftest.py collects the test's garbage at its teardown and
fails it if one was logged. `freeze_imported_objects` makes that collection cheap: it
moves everything alive after the imports (vLLM's and torch's modules, a few 100,000
objects, about a second per collection on a busy machine) out of the collector's sight,
and `workers_pending` skips it where no worker can be awaiting one (most tests build none:
a collection after each of them doubled tests/core's time).
"""

from __future__ import annotations

import gc
import logging
import weakref

from kvtier.transfer.worker_resources import release_dropped

RELEASE_LOGGER = "kvtier.transfer.worker_resources"
DROPPED = "dropped without shutdown()"


class DropRecorder(logging.Handler):
    """Record the "dropped without shutdown()" warnings of the worker release logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.dropped: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if DROPPED in message:
            self.dropped.append(message)

    def __enter__(self) -> DropRecorder:
        logging.getLogger(RELEASE_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        logging.getLogger(RELEASE_LOGGER).removeHandler(self)


def freeze_imported_objects() -> None:
    """Collect, then exempt every object alive now from later collections (`gc.freeze`)."""
    gc.collect()
    gc.freeze()


def workers_pending() -> bool:
    """Return True while a worker not shut down may await collection: its finalizer
    (`release_dropped`, detached by `shutdown()`) is still registered."""
    registry = weakref.finalize._registry  # type: ignore[attr-defined]
    return any(info.func is release_dropped for info in list(registry.values()))
