"""A device error a lane found is reported failed also when an interrupt (Ctrl-C) cuts
its report short and the lane reports the job again.

Regression: the lane asked the job's completion again, and a completion whose query
raised once (the device reported the error) and then answered done made the copy that
failed come back done: its blocks served as if copied.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.transfer import lanes
from kvtier.transfer.lanes import TransferLane

pytestmark = pytest.mark.timeout(60)


class FailsOnce:
    """A completion whose first query raises (a device error), then says done."""

    def __init__(self) -> None:
        self.queries = 0

    def is_done(self) -> bool:
        self.queries += 1
        if self.queries == 1:
            raise RuntimeError("device copy failed")
        return True

    def wait(self) -> None:
        return None

    def elapsed_s(self) -> float | None:
        return None


def test_a_device_error_is_reported_failed_after_an_interrupted_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lane = TransferLane("test")
    completion = FailsOnce()
    lane.submit(1, lambda: completion)
    while not lane._pending[0].future.done():
        pass
    outcome = lanes._outcome
    interrupted: list[bool] = []

    def outcome_then_interrupt(name: str, pending: Any) -> Any:
        result = outcome(name, pending)
        if isinstance(result, BaseException) and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt("Ctrl-C before the lane kept the job's report")
        return result

    monkeypatch.setattr(lanes, "_outcome", outcome_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        lane.finished()
    done, failed = lane.finished()
    assert interrupted == [True]
    assert (done, list(failed)) == ({}, [1])
    lane.acknowledge()
    lane.close()
