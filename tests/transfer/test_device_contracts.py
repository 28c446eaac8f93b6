"""The CUDA plumbing's small promises, against fakes of torch.cuda (no GPU here): what
may be pinned, the stream a lane copies on, where the compute marker is recorded, and a
completion that asks its event (s33 mutation run on `transfer/device.py`: each test
failed on a mutant that passed every older test)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kvtier.transfer.device import (
    CudaCompletion,
    lowest_priority_stream,
    pin_host_memory,
    record_compute_marker,
)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(4, 4)[:, ::2], r"can only pin a contiguous CPU tensor, got cpu"),
        (torch.zeros(4, 4, device="meta"), r"can only pin a contiguous CPU tensor, got meta"),
    ],
    ids=["strided", "not on the cpu"],
)
def test_only_a_contiguous_cpu_tensor_is_pinned(
    tensor: torch.Tensor, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering a strided view would lock bytes it does not own; refused before CUDA
    is asked."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("CUDA was asked"))
    with pytest.raises(ValueError, match=message):
        pin_host_memory(tensor)


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on: Any = "nothing"
        self.reached = False
        self.waited = False

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.waited = True


class FakeStream:
    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        FakeStream.made.append(kwargs)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -5)  # (least, greatest), as CUDA reports them


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: ("current", str(dev)))


@pytest.mark.usefixtures("fake_cuda")
def test_a_lane_stream_has_the_least_priority() -> None:
    """Transfers yield to compute: the lane's stream takes the least priority of the
    range (CUDA numbers it 0, the greatest -5 here)."""
    lowest_priority_stream(torch.device("cuda", 1))
    assert FakeStream.made == [{"device": torch.device("cuda", 1), "priority": 0}]


@pytest.mark.usefixtures("fake_cuda")
def test_the_compute_marker_is_recorded_on_the_engines_current_stream() -> None:
    marker = record_compute_marker(torch.device("cuda", 1))
    assert isinstance(marker, FakeEvent)
    assert marker.recorded_on == ("current", "cuda:1")


@pytest.mark.usefixtures("fake_cuda")
def test_a_completion_asks_its_event_and_waits_on_it() -> None:
    """`is_done` is the event's query, never a guess; `wait` synchronizes on it."""
    done = CudaCompletion("lane stream")  # type: ignore[arg-type]
    event = done._event
    assert isinstance(event, FakeEvent)
    assert event.recorded_on == "lane stream"
    assert not done.is_done()
    event.reached = True
    assert done.is_done()
    done.wait()
    assert event.waited
