"""A persistent disk tier's recovered records, listed while another thread drops them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig

SLOT = 4096

pytestmark = pytest.mark.timeout(60)


class ProbeLock:
    """A lock that sets `contended` when an acquire has to wait for the holder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> ProbeLock:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()


class HookedDict(dict[int, SlotRecord]):
    """A dict whose `items()` calls `hook` after yielding its first item."""

    def __init__(self, items: dict[int, SlotRecord]) -> None:
        super().__init__(items)
        self.hook: Callable[[], None] = _no_hook

    def items(self) -> Iterator[tuple[int, SlotRecord]]:  # type: ignore[override]
        first = True
        for pair in dict.items(self):
            yield pair
            if first:
                first = False
                self.hook()


def _no_hook() -> None:
    pass


def test_records_dropped_while_recovered_slots_lists_them(tmp_path: Path) -> None:
    """Regression: the store I/O thread's end of the records (a failed sync or append)
    cleared the recovered records while `recovered_slots()` on another thread iterated
    them: RuntimeError "dictionary changed size during iteration". The clear now waits
    for the listing, which returns the records as they were when it started."""
    config = DiskTierConfig(
        str(tmp_path / "rank0.slots"),
        num_slots=8,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )
    tier = DiskTier(config)
    records = [SlotRecord(f"k{i}".encode(), 16) for i in range(3)]
    slots = np.array([2, 3, 5], dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, records).result()
    tier.close()
    tier = DiskTier(config)
    expected = [(2, records[0]), (3, records[1]), (5, records[2])]
    assert tier.recovered_slots() == expected

    state = tier._records
    probe = ProbeLock()
    state._lock = probe  # type: ignore[assignment]  # the old code had no lock: unused there
    hooked = HookedDict(state._recovered)
    state._recovered = hooked
    ender = threading.Thread(target=state.end, args=("cannot sync the manifest",))

    def end_on_another_thread() -> None:
        """Start the end and return once it finished or waits for the listing's lock."""
        ender.start()
        while ender.is_alive() and not probe.contended.wait(0.01):
            pass

    hooked.hook = end_on_another_thread
    listed = tier.recovered_slots()
    ender.join()
    assert listed == expected
    assert probe.contended.is_set()
    assert tier.recovered_slots() == []
    tier.check_invariants()
    tier.close()
