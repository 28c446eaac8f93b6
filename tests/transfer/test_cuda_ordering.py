"""The CUDA copier's stream, event and device discipline, checked on the CPU.

`FakeCuda` stands in for torch.cuda's streams, events and device selection and logs each
call with the device and stream current at that moment. A lane thread starts on device 0
(the CUDA runtime's default for a new thread), while the engine's KV cache may live on
another GPU (vLLM's rank k uses cuda:k). The copier's tensors stay on the CPU, so its copy
logic runs for real and the bytes are checked too.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvtier.transfer import copiers
from kvtier.transfer.copiers import CudaCopier, StagingRows

ENGINE_DEVICE = torch.device("cpu")  # stands for the engine's GPU, e.g. cuda:1
LANE_START_DEVICE = "cuda:0"  # what a fresh lane thread has current

LogEntry = tuple[object, ...]


@dataclass
class FakeCuda:
    """Record CUDA calls with the device and stream current on the calling thread."""

    log: list[LogEntry] = field(default_factory=list)
    device: object = LANE_START_DEVICE
    stream: str = "default"
    names: Iterator[int] = field(default_factory=itertools.count)

    @contextlib.contextmanager
    def device_guard(self, device: object) -> Iterator[None]:
        previous, self.device = self.device, device
        try:
            yield
        finally:
            self.device = previous

    def set_device(self, device: object) -> None:
        self.device = device

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name, self.device))
        previous, self.stream = self.stream, stream.name
        try:
            yield
        finally:
            self.stream = previous

    def traced(self, name: str, method: Callable[..., object]) -> Callable[..., object]:
        """Wrap a tensor method so that each call logs the stream it was queued on."""

        def call(*args: object, **kwargs: object) -> object:
            self.log.append((name, self.stream))
            return method(*args, **kwargs)

        return call


@dataclass
class FakeStream:
    cuda: FakeCuda
    name: str

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("sync", self.name))


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        self.cuda = cuda
        self.name = f"event{next(cuda.names)}"
        self.enable_timing = enable_timing

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing, "timing needs a timed start event"
        assert end.enable_timing, "timing needs a timed end event"
        return 2.5  # milliseconds

    def record(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(copiers, "lowest_priority_stream", lambda device: FakeStream(fake, "lane"))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(fake, **kw))
    monkeypatch.setattr(torch.cuda, "stream", fake.stream_context)
    monkeypatch.setattr(torch.cuda, "device", fake.device_guard)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    for name in ("copy_", "index_select", "index_copy_"):
        monkeypatch.setattr(torch.Tensor, name, fake.traced(name, getattr(torch.Tensor, name)))
    return fake


def engine_and_host(widths: tuple[int, ...] = (4, 6)) -> tuple[list[torch.Tensor], ...]:
    """Return engine regions (8 blocks) filled with distinct values, and zeroed host rows."""
    engine = [
        torch.arange(8 * w, dtype=torch.int64).reshape(8, w) + 1000 * r
        for r, w in enumerate(widths)
    ]
    host = [torch.zeros(5, w, dtype=torch.int64) for w in widths]
    return engine, host


def staging_for(widths: tuple[int, ...] = (4, 6)) -> StagingRows:
    spans, start = [], 0
    for w in widths:
        spans.append((start, start + w))
        start += w
    return StagingRows.of(torch.zeros(3, start, dtype=torch.int64), spans)


BLOCKS = np.array([6, 1, 3], dtype=np.int64)
SLOTS = np.array([4, 0, 2], dtype=np.int64)


def store_or_load(
    copier: CudaCopier, kind: str, engine: list[torch.Tensor], host: list[torch.Tensor]
) -> Callable[[], None]:
    """Return the copier's store (engine -> host) or load (host -> engine) of the test's
    blocks and slots, ready to call."""
    if kind == "load":
        return functools.partial(copier.load, host, SLOTS, engine, BLOCKS)
    return functools.partial(copier.store, engine, BLOCKS, host, SLOTS)


def run_copy(copier: CudaCopier, kind: str) -> None:
    """Run one of the copier's four copies on engine blocks BLOCKS and slots / rows."""
    engine, host = engine_and_host()
    staging = staging_for()
    if kind == "store":
        copier.store(engine, BLOCKS, host, SLOTS)
        assert all(torch.equal(h[SLOTS], e[BLOCKS]) for h, e in zip(host, engine, strict=True))
    elif kind == "load":
        for r, h in enumerate(host):
            h[:] = torch.arange(h.numel(), dtype=torch.int64).reshape(h.shape) - 1000 * r
        copier.load(host, SLOTS, engine, BLOCKS)
        assert all(torch.equal(e[BLOCKS], h[SLOTS]) for h, e in zip(host, engine, strict=True))
    elif kind == "store_to_staging":
        copier.store_to_staging(engine, BLOCKS, staging)
        assert torch.equal(staging.rows, torch.cat([e[BLOCKS] for e in engine], dim=1))
    else:
        staging.rows[:] = torch.arange(30, dtype=torch.int64).reshape(3, 10)
        copier.load_from_staging(staging, engine, BLOCKS)
        assert torch.equal(torch.cat([e[BLOCKS] for e in engine], dim=1), staging.rows)


KINDS = ["store", "load", "store_to_staging", "load_from_staging"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_lane_stream_is_made_current_on_the_engine_device(cuda: FakeCuda, kind: str) -> None:
    """A lane thread starts on device 0: entering (and leaving) `torch.cuda.stream` from
    there switches the thread back to device 0, which creates a CUDA context on GPU 0 in
    every rank whose GPU is another (CUDA 12+). The copier makes its device current first."""
    copier = CudaCopier(ENGINE_DEVICE)
    run_copy(copier, kind)
    entries = [entry for entry in cuda.log if entry[0] == "enter"]
    assert entries, "no work was queued on the lane stream"
    assert entries == [("enter", "lane", ENGINE_DEVICE)] * len(entries)
    assert cuda.device == LANE_START_DEVICE, "the thread's device was not restored"


@pytest.mark.parametrize("kind", KINDS)
def test_every_copy_is_queued_on_the_lane_stream(cuda: FakeCuda, kind: str) -> None:
    """Copies never land on the thread's default stream, which would not follow the
    compute-done wait nor precede the completion event."""
    run_copy(CudaCopier(ENGINE_DEVICE), kind)
    copies = [entry for entry in cuda.log if entry[0] in ("copy_", "index_select", "index_copy_")]
    assert copies
    assert {stream for _, stream in copies} == {"lane"}


def test_a_store_waits_for_compute_then_copies_then_records_completion(cuda: FakeCuda) -> None:
    """SPEC scenario 30 (§7 ordering): the wait on the compute-done marker is queued before
    any read of an engine block, and the completion event after the last copy, on the same
    stream."""
    copier = CudaCopier(ENGINE_DEVICE)
    marker = FakeEvent(cuda)
    copier.wait_for_compute(marker)  # type: ignore[arg-type]
    run_copy(copier, "store")
    completion = copier.finish()
    assert completion is not None
    assert completion.is_done()
    kinds = [entry[0] for entry in cuda.log]
    assert cuda.log[0] == ("wait", "lane", marker.name)
    assert cuda.log[-1][:2] == ("record", "lane")
    assert "sync" not in kinds, "a host-tier store must not block its lane"


@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_timed_copy_starts_its_clock_after_the_compute_wait(cuda: FakeCuda, kind: str) -> None:
    """SPEC §6.10 Beyond (transfer time): the start event is queued after the wait on the
    compute marker and before the first copy, so the time is the copy's, not the forward
    pass's; the completion measures device time from it (2.5 ms in the fake)."""
    copier = CudaCopier(ENGINE_DEVICE)
    marker = FakeEvent(cuda)
    copier.wait_for_compute(marker)  # type: ignore[arg-type]
    copier.begin()
    run_copy(copier, kind)
    completion = copier.finish()
    assert completion is not None
    assert completion.elapsed_s() == pytest.approx(0.0025)
    assert cuda.log[0] == ("wait", "lane", marker.name)
    assert cuda.log[1][:2] == ("record", "lane")
    assert cuda.log[-1][:2] == ("record", "lane")
    untimed = copier.finish()  # no begin(): nothing to time
    assert untimed is not None
    assert untimed.elapsed_s() is None


@pytest.mark.parametrize("kind", ["store_to_staging", "load_from_staging"])
def test_staging_copies_finish_before_returning(cuda: FakeCuda, kind: str) -> None:
    """The staging buffer is reused (disk I/O) as soon as the copy returns."""
    run_copy(CudaCopier(ENGINE_DEVICE), kind)
    assert cuda.log[-1] == ("sync", "lane")


@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_failed_copy_waits_for_the_work_it_already_queued(cuda: FakeCuda, kind: str) -> None:
    """A job failing half-way (here: the second region does not fit) is reported failed
    at once; the first region's copies must not still be running then, or they would
    write host slots or GPU blocks the scheduler has already handed to someone else."""
    engine, host = engine_and_host((4, 6))
    host[1] = torch.zeros(5, 5, dtype=torch.int64)  # wrong width: the second region fails
    copier = CudaCopier(ENGINE_DEVICE)
    copy = store_or_load(copier, kind, engine, host)
    with pytest.raises(RuntimeError):
        copy()
    kinds = [entry[0] for entry in cuda.log]
    assert "copy_" in kinds, "the first region was not queued before the failure"
    assert cuda.log[-1] == ("sync", "lane"), "the failed job left its copies running"


@pytest.mark.parametrize("kind", ["store", "load"])
def test_an_interrupted_copy_waits_for_the_work_it_already_queued(
    cuda: FakeCuda, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above for a KeyboardInterrupt landing between two regions' copies (s33
    mutant: `except Exception` let it leave the first region's copies running)."""
    row_runs = copiers._row_runs
    calls = itertools.count()

    def interrupted(rows: np.ndarray) -> list[tuple[int, int, int]]:
        if next(calls) == 1:  # the second region
            raise KeyboardInterrupt
        return row_runs(rows)

    monkeypatch.setattr(copiers, "_row_runs", interrupted)
    engine, host = engine_and_host((4, 6))
    copier = CudaCopier(ENGINE_DEVICE)
    copy = store_or_load(copier, kind, engine, host)
    with pytest.raises(KeyboardInterrupt):
        copy()
    assert "copy_" in [entry[0] for entry in cuda.log]
    assert cuda.log[-1] == ("sync", "lane"), "the interrupted job left its copies running"
