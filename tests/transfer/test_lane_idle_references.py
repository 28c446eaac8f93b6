"""An idle lane holds nothing of its last job: the views a job copied between (of the
engine's KV cache, of a tier) are freed once the job is reported and acknowledged, not
kept until the lane's next job, nor, for a failed job, until a cyclic collection."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

import kvtier.transfer.copy_crew as copy_crew
import kvtier.transfer.lanes as lanes_module
from kvtier.transfer.block_copy import plan_copy
from kvtier.transfer.copy_crew import RegionCopy
from kvtier.transfer.lanes import TransferLane

pytestmark = pytest.mark.timeout(60)

# How long the lane's thread may take to come back to its queue after settling a job.
_SETTLE_S = 5.0


def _copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def _failing_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)
    raise OSError("disk full")  # the traceback holds this frame, and so both views


def _views() -> tuple[torch.Tensor, torch.Tensor, list[weakref.ref[torch.Tensor]]]:
    """Return two views of a cache and weak references to them."""
    cache = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    src, dst = cache[0], cache[1]
    return src, dst, [weakref.ref(src), weakref.ref(dst)]


def _all_freed(refs: list[weakref.ref[Any]], collect: Callable[[], object]) -> bool:
    """Return True once no view is alive, waiting up to `_SETTLE_S` for the lane's thread
    (which settles a job's future before it returns to its queue)."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        collect()
        if all(ref() is None for ref in refs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    """Free by reference counts alone while the test runs (after collecting what earlier
    tests left)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def lane() -> Iterator[TransferLane]:
    lane = TransferLane("test")
    yield lane
    lane.close()


def test_a_done_job_is_collectable_once_reported(lane: TransferLane) -> None:
    """Regression: the lane's thread kept its last job (and so the job's views) in its
    locals while it waited for the next one."""
    src, dst, refs = _views()
    lane.submit(1, partial(_copy, src, dst))
    del src, dst
    lane.wait_all()
    done, failed = lane.finished()
    assert list(done) == [1]
    assert not failed
    assert _all_freed(refs, gc.collect), "an idle lane keeps its last job's views alive"


def _check_failed_and_freed(
    lane: TransferLane, refs: list[weakref.ref[Any]], error: type[BaseException]
) -> None:
    """Job 1 failed with `error`; once its report is acknowledged, with the cycle
    collector off, nothing holds its views any more."""
    lane.wait_all()
    done, failed = lane.finished()
    assert not done
    assert isinstance(failed[1], error)
    del failed
    lane.acknowledge()
    assert _all_freed(refs, lambda: None), "a failed job's views wait for the gc"


@pytest.mark.usefixtures("no_cycle_collector")
def test_a_failed_job_is_freed_without_the_cycle_collector(
    lane: TransferLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a failed job's error held the frame that ran it, whose locals held the
    job's future, which held the error: a reference cycle that kept the job's views
    (device memory) until a cyclic collection, however long that took."""
    # A log record keeps its arguments, the error among them: no handler may hold one.
    monkeypatch.setattr(lanes_module.logger, "disabled", True)
    src, dst, refs = _views()
    lane.submit(1, partial(_failing_copy, src, dst))
    del src, dst
    _check_failed_and_freed(lane, refs, OSError)


@pytest.mark.usefixtures("no_cycle_collector")
def test_a_batch_failed_on_a_crew_helper_is_freed_without_the_cycle_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: as above, through the copy crew: the helper's frame held the share's
    future, and the crew's `run` frame the futures and the error it raised."""
    monkeypatch.setattr(lanes_module.logger, "disabled", True)
    copy_rows = copy_crew.copy_rows

    def helper_fails(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("kvtier-crewfail-copy"):
            raise ValueError("helper share failed")
        copy_rows(plan, src, dst, a, b, scratch)

    monkeypatch.setattr(copy_crew, "copy_rows", helper_fails)
    lane = TransferLane("crewfail", copy_threads=2)
    try:
        lane.crew.min_share_bytes = 1  # a share for the helper however small the batch
        src = np.arange(64, dtype=np.int64).reshape(16, 4)
        dst = np.zeros_like(src)
        refs = [weakref.ref(src), weakref.ref(dst)]
        copies = [RegionCopy(plan_copy(np.arange(16), np.arange(16), 32), src, dst)]
        lane.submit(1, partial(lane.crew.run, copies))
        del src, dst, copies
        _check_failed_and_freed(lane, refs, ValueError)
    finally:
        lane.close()
