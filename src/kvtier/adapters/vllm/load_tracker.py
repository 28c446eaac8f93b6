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
are logged), every request of it fails; the worker then reports the event to the
scheduler without its names (`unsplit`), so the scheduler fails it whole too.

Block-level failures (`block_level`, vLLM's `get_block_ids_with_load_errors`): a request
whose every failed event named its bad blocks (by the rule above) is reported finished,
not failed, and the GPU blocks its bad source blocks were copied into are returned by
`take_invalid_blocks` in the same step: vLLM keeps its tokens before the first of them
(its local prefix and the blocks loaded whole before it) and recomputes from there
(`Scheduler._handle_invalid_blocks`). Every other destination block of such an event was
copied whole and verified (`WorkerReport.bad_blocks`). A request with any failure that
named nothing is failed whole. Off (the default), a named failure fails its readers whole.
The parts of a load are built only when it fails: a step without failures does no
per-block work here.
No vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvtier.offload.plan import TransferJob

logger = logging.getLogger(__name__)


class LoadTracker:
    """Turn finished load events into finished and failed request ids."""

    def __init__(self, block_level: bool = False) -> None:
        """`block_level`: report requests whose failures all named their bad blocks by
        those blocks' GPU destinations (see the module docstring), not as failed."""
        self.block_level = block_level
        self._listed: Mapping[int, tuple[str, ...]] = {}
        self._waiting: dict[str, set[int]] = {}  # request id -> its events not yet finished
        self._failed: set[str] = set()  # requests with a failed event, still waiting
        # Of `_failed`: the suspect GPU blocks of those whose every failure named its
        # bad blocks (block_level only); a request failed whole is not in it.
        self._suspects: dict[str, set[int]] = {}
        self._invalid: set[int] = set()  # suspects of requests reported finished
        self._finished: set[int] = set()  # events finished here, still listed
        self._parts: dict[int, TransferJob] = {}  # load jobs with valid parts, by event
        self.unsplit: set[int] = set()  # of the last `complete` (see there)

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
            self._parts[job.event_id] = job  # split into parts only if it fails
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

        Afterwards `unsplit` holds the failed events of this call that were failed whole
        although `bad_blocks` named blocks of them (parts unknown or invalid, names not
        all sources): their report to the scheduler must name none, or it would fail only
        the readers of those blocks while vLLM recomputes every request of the event.
        """
        touched: set[str] = set()
        self.unsplit = set()
        for event_ids, is_failure in ((done, False), (failed, True)):
            for event_id in event_ids:
                request_ids = self._listed.get(event_id)
                if request_ids is None or event_id in self._finished:
                    continue
                self._finished.add(event_id)
                job = self._parts.pop(event_id, None)
                if is_failure:
                    named = None if bad_blocks is None else bad_blocks.get(event_id)
                    if not self._note_failure(request_ids, job, named) and named:
                        self.unsplit.add(event_id)
                for request_id in request_ids:
                    waiting = self._waiting.get(request_id)
                    if waiting is not None:
                        waiting.discard(event_id)
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
                suspects = self._suspects.pop(request_id, None)
                if suspects:  # every failure of it named its blocks: vLLM keeps a prefix
                    self._invalid.update(suspects)
                else:
                    failed_ids.add(request_id)
        return finished, failed_ids

    def _note_failure(
        self, request_ids: tuple[str, ...], job: TransferJob | None, named: frozenset[int] | None
    ) -> bool:
        """Fail the requests of a failed event: only those reading one of the `named` bad
        source blocks when they are some of its sources and its parts are known (where
        `block_level`, by their suspect GPU blocks); else every request, whole. Return
        True when it was split by the named blocks."""
        bad = named or frozenset()
        parts = None if job is None or not bad else _split(job, request_ids)
        if parts is None or not bad <= frozenset(b for _, src, _ in parts for b in src):
            parts = None  # fail closed: every request of the event, whole
        for request_id in request_ids:
            suspects = None if parts is None else _suspects(parts, request_id, bad)
            if parts is not None and not suspects:
                continue  # it read no bad block: finished normally
            first_failure = request_id not in self._failed
            self._failed.add(request_id)
            if suspects is None or not self.block_level:
                self._suspects.pop(request_id, None)  # failed whole
            elif first_failure:
                self._suspects[request_id] = suspects
            elif request_id in self._suspects:  # else failed whole by an earlier event
                self._suspects[request_id] |= suspects
        return parts is not None

    def take_invalid_blocks(self) -> set[int]:
        """Return and forget the suspect GPU blocks of the requests `complete` reported
        finished after a failure (block_level; vLLM's `invalid_block_ids`)."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def __len__(self) -> int:
        """Return how many requests wait for a load event (tests: no leaks)."""
        return len(self._waiting)

    def is_idle(self) -> bool:
        """Return True when nothing is waiting, failed or remembered (tests: no leaks)."""
        return (
            not self._waiting
            and not self._failed
            and not self._parts
            and not self._suspects
            and not self._invalid
        )


def _split(
    job: TransferJob, request_ids: tuple[str, ...]
) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """Return each request's (id, source blocks, destination blocks) of a load job with
    valid parts (checked in `LoadTracker.update`)."""
    parts, start = [], 0
    for request_id, size in zip(request_ids, job.load_parts, strict=True):
        end = start + size
        parts.append((request_id, job.src_block_ids[start:end], job.dst_block_ids[start:end]))
        start = end
    return tuple(parts)


def _suspects(
    parts: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...],
    request_id: str,
    bad: frozenset[int],
) -> set[int]:
    """Return the GPU blocks `request_id`'s part of a load copied a `bad` source into."""
    return {
        dst_block
        for reader, src, dst in parts
        if reader == request_id
        for src_block, dst_block in zip(src, dst, strict=True)
        if src_block in bad
    }
