"""CUDA plumbing for the worker: page-locking host memory, streams, completion markers.

Everything here is only called when the engine's KV tensors live on a CUDA device; the CPU
path never touches it.
"""

from __future__ import annotations

from typing import Protocol

import torch

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context


class Completion(Protocol):
    """Marks the end of the device work of one job."""

    def is_done(self) -> bool:
        """Return True once the work finished; never blocks; raises on a device error."""
        ...

    def wait(self) -> None:
        """Block until the work finished; raises on a device error."""
        ...

    def elapsed_s(self) -> float | None:
        """Return the seconds the device work took once done, or None if not timed."""
        ...


class CudaCompletion:
    """A `Completion` backed by a CUDA event recorded on a stream.

    With `start` (a timing event recorded on the stream when the job's copies began),
    `elapsed_s` is the device time between the two events.
    """

    def __init__(self, stream: torch.cuda.Stream, start: torch.cuda.Event | None = None) -> None:
        self._start = start
        self._event = torch.cuda.Event(enable_timing=start is not None)
        self._event.record(stream)

    def is_done(self) -> bool:
        """Return True once the stream reached the event."""
        return bool(self._event.query())

    def wait(self) -> None:
        """Block until the stream reached the event."""
        self._event.synchronize()

    def elapsed_s(self) -> float | None:
        """Return the device seconds from the start event to this one (both reached)."""
        if self._start is None:
            return None
        return float(self._start.elapsed_time(self._event)) / 1000.0


def timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Record a timing event on `stream` (the start of a job's device work)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def pin_host_memory(tensor: torch.Tensor) -> None:
    """Page-lock the bytes of a contiguous CPU tensor in place (no rounding, no copy).

    `torch.Tensor.pin_memory()` would copy into the caching host allocator, which rounds
    sizes up to powers of two; registering keeps memory use equal to the budget. Call
    `unpin_host_memory` before the tensor is freed. Raises RuntimeError naming the CUDA
    error code, the address and the byte size on failure.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"can only pin a contiguous CPU tensor, got {tensor.device} "
            f"with strides {tensor.stride()}"
        )
    ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(_cuda_error("cudaHostRegister", ptr, nbytes, code))


def unpin_host_memory(tensor: torch.Tensor) -> None:
    """Undo `pin_host_memory`; raises RuntimeError naming the CUDA error code, the address
    and the byte size on failure."""
    ptr = tensor.data_ptr()
    code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if code != 0:
        nbytes = tensor.numel() * tensor.element_size()
        raise RuntimeError(_cuda_error("cudaHostUnregister", ptr, nbytes, code))


def _cuda_error(call: str, ptr: int, nbytes: int, code: int) -> str:
    return f"{call} of {nbytes} B at {ptr:#x} failed with CUDA error {code}"


def lowest_priority_stream(device: torch.device) -> torch.cuda.Stream:
    """Return a new stream of the lowest priority on `device` (transfers yield to compute)."""
    try:
        least_priority, _ = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    except TypeError:  # builds that expose it as an instance method
        least_priority, _ = torch.cuda.current_stream(device).priority_range()
    return torch.cuda.Stream(device=device, priority=least_priority)


def record_compute_marker(device: torch.device) -> torch.cuda.Event:
    """Record an event on the caller's current stream of `device` (the engine's compute)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
