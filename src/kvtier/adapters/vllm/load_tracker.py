"""Which requests' loads are complete on one worker, across events and steps.

With the CPU+disk cascade one request's load may be two load events (a CPU → GPU job and
a DISK → GPU job), and they may finish in different steps. vLLM must hear of the request
once, when every event listing it is done on this worker: earlier, its tokens would be
computed (or recomputed, after a failure) while a copy still writes its blocks. If any
of its events failed, the request is failed (and finished).

`TransferPlan.load_request_ids` lists every load event the scheduler still waits for,
so an event this worker finished may be listed again until every worker reported it;
the tracker remembers those, and forgets them once the scheduler stops listing them.

A failed event whose bad source blocks this worker named (`WorkerReport.bad_blocks`)
fails only the requests that read one of them, by the parts each load job lists
(`TransferJob.load_parts`); the others finish normally. The scheduler applies the same
rule to the ranks' merged report (the union of their bad blocks), so vLLM's union of
the ranks' failed requests is the set of requests kvtier recomputes. Without names, or
with names that are not all source blocks of the event, or without valid parts (one
block count >= 1 per request, adding up: `TransferJob.check_load_parts`; invalid ones
are logged), every request of it fails.
No vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvtier.offload.plan import TransferJob

logger = logging.getLogger(__name__)


class LoadTracker:
    """Turn finished load events into finished and failed request ids."""

    def __init__(self) -> None:
        self._listed: Mapping[int, tuple[str, ...]] = {}
        self._waiting: dict[str, set[int]] = {}  # request id -> its events not yet finished
        self._failed: set[str] = set()  # requests with a failed event, still waiting
        self._finished: set[int] = set()  # events finished here, still listed
        self._parts: dict[int, tuple[tuple[str, frozenset[int]], ...]] = {}  # by event

    def update(
        self, load_request_ids: Mapping[int, tuple[str, ...]], jobs: Iterable[TransferJob] = ()
    ) -> None:
        """Take the scheduler's map of outstanding load events (every step's plan), and
        the source blocks of each request of the plan's new load `jobs`."""
        self._finished.intersection_update(load_request_ids)
        self._parts = {e: p for e, p in self._parts.items() if e in load_request_ids}
        for job in jobs:
            request_ids = load_request_ids.get(job.event_id)
            if request_ids is None or not job.load_parts:
                continue  # not a load, or one whose parts are unknown: it fails whole
            try:  # the job came by pickle: its own checks did not run here
                job.check_load_parts(request_ids)
            except ValueError as exc:
                logger.warning("%s; a failure of the event fails all its requests", exc)
                continue
            parts, start = [], 0
            for request_id, size in zip(request_ids, job.load_parts, strict=True):
                parts.append((request_id, frozenset(job.src_block_ids[start : start + size])))
                start += size
            self._parts[job.event_id] = tuple(parts)
        self._listed = load_request_ids
        for event_id, request_ids in load_request_ids.items():
            if event_id in self._finished:
                continue
            for request_id in request_ids:
                self._waiting.setdefault(request_id, set()).add(event_id)

    def complete(
        self,
        done: Iterable[int],
        failed: Iterable[int],
        bad_blocks: Mapping[int, frozenset[int]] | None = None,
    ) -> tuple[set[str], set[str]]:
        """Record finished events; return (finished, failed) request ids now complete.

        Events the map does not list (stores, demotions) are ignored. A failed request
        is also in the finished set. `bad_blocks`: the bad source blocks of failed events,
        where this worker named them (see the module docstring).
        """
        touched: set[str] = set()
        for event_ids, is_failure in ((done, False), (failed, True)):
            for event_id in event_ids:
                request_ids = self._listed.get(event_id)
                if request_ids is None or event_id in self._finished:
                    continue
                self._finished.add(event_id)
                parts = self._parts.pop(event_id, None)
                failing = set(request_ids) if is_failure else set()
                if is_failure and bad_blocks is not None and event_id in bad_blocks:
                    failing = _readers(parts, bad_blocks[event_id], failing)
                for request_id in request_ids:
                    waiting = self._waiting.get(request_id)
                    if waiting is not None:
                        waiting.discard(event_id)
                    if request_id in failing:
                        self._failed.add(request_id)
                    touched.add(request_id)
        finished: set[str] = set()
        failed_ids: set[str] = set()
        for request_id in touched:
            if self._waiting.get(request_id):
                continue
            self._waiting.pop(request_id, None)
            finished.add(request_id)
            if request_id in self._failed:
                self._failed.discard(request_id)
                failed_ids.add(request_id)
        return finished, failed_ids

    def __len__(self) -> int:
        """Return how many requests wait for a load event (tests: no leaks)."""
        return len(self._waiting)

    def is_idle(self) -> bool:
        """Return True when nothing is waiting, failed or remembered (tests: no leaks)."""
        return not self._waiting and not self._failed and not self._parts


def _readers(
    parts: tuple[tuple[str, frozenset[int]], ...] | None, bad: frozenset[int], every: set[str]
) -> set[str]:
    """Return the requests of an event (`parts`) that read a block of `bad`; `every`
    request of it when its parts are unknown or `bad` is empty or not all its source
    blocks (the scheduler's rule, `IssuedTransfer.note_failure`)."""
    if parts is None or not bad or not bad <= frozenset().union(*(b for _, b in parts)):
        return every
    return {request_id for request_id, blocks in parts if blocks & bad}
