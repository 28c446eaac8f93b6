"""The report hand-off of an `OffloadWorker` (see `worker`): finished events, read from
its lanes and handed to the caller as one `WorkerReport`.

`WorkerReports` is a mixin of `OffloadWorker`. `peek` returns the events finished and not
yet acknowledged, again on every call until `acknowledge`; `poll` does both at once. A
caller that an interrupt must not cost a report peeks, applies or keeps the report, then
acknowledges: an interrupt in between leaves the events to be reported again.
"""

from __future__ import annotations

from kvtier.offload.plan import WorkerReport
from kvtier.transfer.disk_mover import PartlyLoadedError
from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.routes import Direction

__all__ = ["WorkerReports"]


class WorkerReports:
    """The report hand-off over the lanes and in-flight events an `OffloadWorker` owns
    and sets up in its `__init__`; call from the worker's thread."""

    _lanes: dict[Direction, TransferLane]
    _in_flight: set[int]

    def poll(self) -> WorkerReport:
        """Return the events finished since the last poll (FIFO per lane); never blocks.
        A caller an interrupt must not cost a report calls `peek`, then `acknowledge`."""
        report = self.peek()
        self.acknowledge()
        return report

    def peek(self) -> WorkerReport:
        """Return the events finished and not yet acknowledged (FIFO per lane), those an
        earlier `peek` returned included; never blocks."""
        done: dict[int, int] = {}
        failed: dict[int, int] = {}
        seconds: dict[int, float] = {}
        bad_blocks: dict[int, frozenset[int]] = {}
        for lane in self._lanes.values():
            lane_done, lane_failed = lane.finished()
            done.update(dict.fromkeys(lane_done, 1))
            seconds.update(lane_done)
            failed.update(dict.fromkeys(lane_failed, 1))
            for event_id, error in lane_failed.items():
                # Only bad disk slots, each a source block id of the job (slot ids are
                # the sources of every disk read); the job's other blocks were copied.
                if isinstance(error, PartlyLoadedError):
                    bad_blocks[event_id] = frozenset(error.slots)
                    if error.seconds is not None:  # the other blocks' copy time
                        seconds[event_id] = error.seconds
        self._in_flight.difference_update(done, failed)
        return WorkerReport(done=done, failed=failed, seconds=seconds, bad_blocks=bad_blocks)

    def acknowledge(self) -> None:
        """Forget the events `peek` returned, whose reports the caller holds or applied
        (an acknowledge cut short by an interrupt leaves some to be reported again)."""
        for lane in self._lanes.values():
            lane.acknowledge()
