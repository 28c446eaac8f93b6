"""Hold the offload worker's reports back from an engine, so that the transfers it
issued stay in flight as far as the engine can tell."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.engine.llm import LLM
from kvtier.offload.plan import WorkerReport


class GatedReports:
    """A worker whose reports are held back until `opened`; everything else passes."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.opened = False

    def peek(self) -> WorkerReport:
        return self.worker.peek() if self.opened else WorkerReport()

    def acknowledge(self) -> None:
        if self.opened:
            self.worker.acknowledge()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


@contextmanager
def reports_held_back(llm: LLM) -> Iterator[None]:
    """Hold back every report of `llm`'s worker inside the block; the first poll after it
    sees them all. An idle step waits for the transfers before it polls: without this, a
    load issued by a step is usually applied by that same step."""
    assert llm.offload is not None
    worker = llm.offload.worker
    llm.offload.worker = GatedReports(worker)
    try:
        yield
    finally:
        llm.offload.worker = worker
