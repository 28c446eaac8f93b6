"""What a lane logs of a failed job: the report carries only the event id, so the log is
the one place its error can be read, a bug's type and traceback included."""

from __future__ import annotations

import errno
import logging

import pytest
from transfer_helpers import take_finished

from kvtier.transfer.lanes import TransferLane

pytestmark = pytest.mark.timeout(60)


def _broken_copy() -> None:
    raise AssertionError  # as a bare `assert` in a copy path does: no message


def test_a_job_failing_with_a_bug_logs_its_type_and_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: the lane logged only `str(error)`, an empty string here ("transfer event
    1 failed: "), so a copy thread's bug left nothing to find it by."""
    lane = TransferLane("test")
    lane.submit(1, _broken_copy)
    lane.wait_all()
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
        _, failed = take_finished(lane)
    lane.close()
    assert list(failed) == [1]
    (record,) = [r for r in caplog.records if "transfer event 1 failed" in r.getMessage()]
    assert record.exc_info is not None
    assert "AssertionError" in caplog.text
    assert "_broken_copy" in caplog.text  # the frame that raised


def test_an_io_error_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """An expected failure (an I/O error: a full or failing disk) is logged by its
    message alone, without a traceback per failed job."""

    def failing_io() -> None:
        raise OSError(errno.EIO, "Input/output error")

    lane = TransferLane("test")
    lane.submit(1, failing_io)
    lane.wait_all()
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.lanes"):
        take_finished(lane)
    lane.close()
    (record,) = caplog.records
    assert record.getMessage() == "lane test: transfer event 1 failed: [Errno 5] Input/output error"
    assert record.exc_info is None
