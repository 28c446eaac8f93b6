"""A shutdown whose hand-over of dropped slots' records fails still stops the worker.

`OffloadSide.shutdown` hands the worker the records no plan dropped yet (or a reset's end
of persistence) before stopping it; `DiskTier.forget` raises OSError when it can neither
append the tombstones nor empty or remove the manifest. Regression: the error skipped the
worker's shutdown (threads and files left to the collector), and the engine, marked shut
down, never retried it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_llm_persist_dropped import (
    ENGINE,
    MODEL,
    Faults,
    held_on_the_tiers_only,
    persistent,
    step_until_its_disk_load_failed,
)

from kvtier.engine.llm import LLM
from kvtier.transfer.worker import WorkerState


class FailingForget(Faults):
    """`Faults`, and `forget_slots` raises OSError, as on a disk that fails every write."""

    def forget_slots(self, slots: Any) -> None:
        raise OSError("cannot drop the manifest's records")


def test_a_failing_hand_over_at_shutdown_still_stops_the_worker(tmp_path: Path) -> None:
    llm = LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE)
    assert llm.offload is not None
    worker = llm.offload.worker
    faults = held_on_the_tiers_only(llm, FailingForget)
    # Until the load failed, no plan carries its slots yet; the hand-over right after
    # the report fails (OSError).
    step_until_its_disk_load_failed(llm, faults, OSError)
    assert llm.offload.scheduler.dropped_slots  # refused: kept for the shutdown
    with pytest.raises(OSError, match="cannot drop"):
        llm.shutdown()
    assert worker.state is WorkerState.SHUT_DOWN
