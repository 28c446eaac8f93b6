"""The disk tier's staging buffers, and the handle of a queued read into one."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtier.storage.slot_file import DIRECT_IO_ALIGNMENT

__all__ = ["SlotRead", "StagingBuffer"]


@dataclass(frozen=True, eq=False)
class StagingBuffer:
    """A page-aligned host buffer of `capacity` slots: `tensor` and `memory` alias it."""

    tensor: torch.Tensor  # uint8 [capacity, bytes_per_slot]
    memory: memoryview  # the same bytes, flat, for the file I/O

    @property
    def capacity(self) -> int:
        """Return the number of slots the buffer holds."""
        return int(self.tensor.shape[0])

    @staticmethod
    def allocate(capacity: int, bytes_per_slot: int) -> StagingBuffer:
        """Return a zeroed (pre-touched) buffer aligned to 4096 bytes."""
        nbytes = capacity * bytes_per_slot
        raw = torch.zeros(nbytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8)
        shift = -raw.data_ptr() % DIRECT_IO_ALIGNMENT
        flat = raw[shift : shift + nbytes]
        return StagingBuffer(flat.view(capacity, bytes_per_slot), memoryview(flat.numpy().data))


class SlotRead:
    """A queued read of slots into a staging buffer."""

    def __init__(self, future: Future[None], verify: Callable[[], None]) -> None:
        self._future = future
        self._verify = verify

    def result(self) -> None:
        """Wait for the read, then verify every slot's checksum; raise DiskIOError."""
        self._future.result()
        self._verify()

    def wait(self) -> None:
        """Wait for the read to finish, ignoring its outcome (the buffer is free again)."""
        self._future.exception()
