"""What an `OffloadWorker` checks in `check_invariants`: no event pending twice, the
in-flight events match the lanes', the state matches the regions and tiers held, and the
host tier and disk slots are laid out as the regions are.

Kept apart from `worker` so that module holds the worker's operations only; the checks
read its lanes, regions and tiers directly, as its own method would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.transfer.worker_config import WorkerState

if TYPE_CHECKING:
    from kvtier.transfer.worker import OffloadWorker


def check_worker_invariants(worker: OffloadWorker) -> None:
    """Raise AssertionError if `worker`'s bookkeeping or tiers are inconsistent."""
    pending = [e for lane in worker._lanes.values() for e in lane.pending_event_ids()]
    assert len(pending) == len(set(pending)), f"an event is pending twice: {pending}"
    reported = [e for lane in worker._lanes.values() for e in lane.reported_event_ids()]
    assert set(pending).difference(reported) == worker._in_flight, "in-flight vs lanes"
    host = worker._held.host
    if worker.state is WorkerState.CREATED:
        assert worker._regions is None, "regions before register()"
    if worker._regions is None:  # never registered (or register() failed)
        assert worker.state is not WorkerState.REGISTERED, "registered without regions"
        assert not worker._held.has_tiers, "tiers held without regions"
        return
    if worker.state is WorkerState.SHUT_DOWN:
        assert not worker._held.has_tiers, "tiers held after shutdown()"
    regions = worker._regions
    assert regions.regions, "no regions"
    assert all(r.num_blocks == regions.num_blocks for r in regions.regions)
    if host is not None:
        host.check_invariants()
        widths = [v.shape[1] for v in host.views]
        assert widths == [r.bytes_per_block for r in regions.regions], "host tier layout"
        assert host.num_slots == worker.config.cpu_num_slots
    if worker._disk is not None:
        worker._disk.disk.check_invariants()
        assert worker._disk.disk.config.bytes_per_slot == regions.bytes_per_slot
        size = worker._engine_rows[0].element_size()
        columns = tuple((a * size, b * size) for a, b in worker._disk.spans)
        assert columns == regions.slot_columns(), "disk slot layout"
