"""The host memory tier: one `[num_slots, bytes_per_block]` uint8 tensor per region."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.transfer.device import pin_host_memory, unpin_host_memory
from kvtier.transfer.release_errors import error_to_raise

logger = logging.getLogger(__name__)


class HostTier:
    """Host memory for `num_slots` slots, laid out region by region.

    Memory is zeroed (which also pre-touches every page) and, with `pin`, page-locked in
    place with `cudaHostRegister`, so memory use is exactly `num_slots * bytes_per_slot`.
    Holds no policy: which slot holds what is the scheduler's business. `close()` unpins;
    it must run before the tensors are dropped. Raises MemoryError naming the slot count
    and bytes when the memory cannot be allocated; a failed pin unpins the regions pinned
    before it and is raised (a failed unpin there is added to it as a note).
    """

    def __init__(self, bytes_per_block: Sequence[int], num_slots: int, pin: bool) -> None:
        if num_slots <= 0:
            raise ValueError(f"host tier needs a positive slot count, got {num_slots}")
        if not bytes_per_block or min(bytes_per_block) <= 0:
            raise ValueError(f"host tier needs positive region sizes, got {list(bytes_per_block)}")
        self.num_slots = num_slots
        self.views: tuple[torch.Tensor, ...] = _allocate(bytes_per_block, num_slots)
        self._pinned: list[torch.Tensor] = []
        if pin:
            try:
                for view in self.views:
                    pin_host_memory(view)
                    self._pinned.append(view)
            except BaseException as exc:
                try:
                    self.close()
                except Exception as unpin_error:  # the pin error says why: raise that one
                    exc.add_note(f"unpinning the regions pinned so far failed: {unpin_error!r}")
                raise
        logger.info(
            "host tier: %d slots x %d B = %.1f MiB%s",
            num_slots,
            self.bytes_per_slot,
            num_slots * self.bytes_per_slot / 2**20,
            " (pinned)" if pin else "",
        )

    @property
    def bytes_per_slot(self) -> int:
        """Return the bytes of one slot over all regions."""
        return sum(view.shape[1] for view in self.views)

    @property
    def is_pinned(self) -> bool:
        """Return True while the memory is page-locked."""
        return bool(self._pinned)

    def check_invariants(self) -> None:
        """Raise AssertionError if a region tensor lost its shape, dtype or layout."""
        for view in self.views:
            assert view.shape[0] == self.num_slots, f"region has {view.shape[0]} slots"
            assert view.dtype == torch.uint8, f"region tensor is {view.dtype}"
            assert view.is_contiguous(), "region tensor is not contiguous"
            assert view.untyped_storage().nbytes() == view.numel(), "memory beyond the budget"
        assert not self._pinned or len(self._pinned) == len(self.views), "partly pinned"

    def close(self) -> None:
        """Unpin the memory (idempotent); the tensors stay usable as plain memory.

        Every region is unpinned even when one fails or is interrupted (the worker drops
        the tier once `close()` returns or raises, so nobody could finish the job later).
        After them all, an interrupt (KeyboardInterrupt, SystemExit) is re-raised, else the
        first failure. A region whose unpin failed is not retried.
        """
        errors: list[BaseException] = []
        while self._pinned:
            try:
                unpin_host_memory(self._pinned.pop())
            except BaseException as exc:
                logger.warning("host tier: unpinning a region failed: %r", exc)
                errors.append(exc)
        if errors:
            raise error_to_raise(errors)


def _allocate(bytes_per_block: Sequence[int], num_slots: int) -> tuple[torch.Tensor, ...]:
    """Return one zeroed `[num_slots, size]` tensor per region size."""
    try:
        return tuple(torch.zeros((num_slots, size), dtype=torch.uint8) for size in bytes_per_block)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator raises RuntimeError
        per_slot = sum(bytes_per_block)
        total = num_slots * per_slot
        raise MemoryError(
            f"cannot allocate the host tier: cpu_num_slots={num_slots} slots x {per_slot} B "
            f"per slot = {total} B ({total / 2**30:.1f} GiB); lower the CPU tier size "
            f"(cpu_bytes / cpu_num_slots): {exc}"
        ) from exc
