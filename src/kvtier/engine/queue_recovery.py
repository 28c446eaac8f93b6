"""The scheduler's queues made whole again after an interrupt (Ctrl-C), and the frees
and moves that an interrupt may cut short.

`Scheduler` keeps its queues (`waiting`, `running`, `loading`) consistent one statement
at a time: a request moving between them is added to its new queue first and taken from
the old one last, and tables taken from a request are freed from `_unfreed`. What an
interrupt left half done, `_settle` finishes before the next schedule or applied load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvtier.core.block_pool import BlockPool
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.load_failure import rewind
from kvtier.engine.request import Request, RequestStatus
from kvtier.offload.scheduler import OffloadScheduler
from kvtier.offload.transfers import FailedLoad


class QueueRecovery:
    """Finish queue moves and frees an interrupt cut short (a base of `Scheduler`)."""

    layout: KVLayout
    pool: BlockPool
    offload: OffloadScheduler | None
    waiting: deque[Request]
    running: list[Request]
    loading: dict[str, Request]
    # Tables taken from requests, their blocks not freed yet (an interrupt): `_settle`.
    _unfreed: list[list[int]]
    # Requests whose abort (`Scheduler.abort`) has not ended: `_settle` ends it.
    _aborting: dict[str, Request]
    abort: Callable[[Request], None]

    def _settle(self) -> None:
        """Finish a move between queues that an interrupt (Ctrl-C) cut short.

        A move sets the request's status to where it goes, adds it there, and takes it
        from where it was last: a request is never in no queue (a turn run by `step`
        would never finish, its blocks leak). One caught in two queues is the head of
        `waiting`, admitted (loading, or running last) or preempted (running last). One
        admitted to a load that an interrupt kept from being queued is rewound (`_unload`).
        One whose admission was cut short as it took blocks (waiting, holding blocks with
        nothing computed) gives them back. An abort cut short is ended first.
        """
        self.end_aborts()
        if not self.waiting:
            return
        head = self.waiting[0]
        if head.status is RequestStatus.WAITING_FOR_LOAD and not self._load_queued(head):
            self._unload(head)  # admitted, cut short before its load was queued
        elif head.status is RequestStatus.WAITING_FOR_LOAD:  # admitted, its load queued
            self.loading[head.request_id] = head
            self.waiting.popleft()
        elif head.status is RequestStatus.RUNNING and head in self.running:  # admitted
            self.waiting.popleft()
        elif self.running and self.running[-1] is head:  # preempted
            self.running.pop()
        elif head.num_computed_tokens == 0 and any(head.block_tables):
            self._free_blocks(head)  # admitted, cut short as it took its blocks

    def end_aborts(self) -> None:
        """End the aborts an interrupt (Ctrl-C) cut short and no retry ended, and free the
        tables taken whose frees it cut short: the state a completed abort leaves. Done
        by `_settle`, and before anything that reads `has_unfinished` between steps
        (`LLM.reset_prefix_cache`). Safe to cut short in turn: `abort` is safe to repeat,
        and a request leaves `_aborting` only once its abort has ended."""
        for request in [*self._aborting.values()]:
            self.abort(request)
        self._free_unfreed()

    def _load_queued(self, request: Request) -> bool:
        assert self.offload is not None, "only an offloading engine loads"
        return self.offload.holds_load(request.request_id, request.block_tables)

    def _unload(self, request: Request) -> None:
        """Rewind a request admitted to a load that was never queued, as one whose load
        failed having loaded nothing: it recomputes from scratch, waiting again. Safe to
        repeat (an interrupt): it stays loading, for `_settle`, until its blocks are freed."""
        end = request.num_computed_tokens
        if end > 0:  # not on a repeat past the rewind
            failed = FailedLoad(request.request_id, end - request.num_external_tokens, end)
            rewind(self.layout, request, failed, None)
        self._free_blocks(request)
        request.status = RequestStatus.WAITING

    def _free_blocks(self, request: Request) -> None:
        # Taken first, in one statement: an interrupt never frees a block twice.
        self._unfreed, request.block_tables = (
            [*self._unfreed, *request.block_tables],
            [[] for _ in self.layout.groups],
        )
        self._free_unfreed()

    def _free_unfreed(self) -> None:
        """Free the blocks of the tables taken (`_free_blocks`); cut short, `_settle`
        frees the rest (a table leaves the list as it is freed, in one line)."""
        while self._unfreed:
            self.pool.free(reversed(self._unfreed.pop(0)))  # tail-first: roots evicted last

    def _resume(self, request: Request) -> None:
        """Queue a request back from its load first; it leaves `loading` last, so a
        repeat (an interrupt in between) neither loses it nor queues it twice."""
        request.status = RequestStatus.WAITING
        if request not in self.waiting:
            self.waiting.appendleft(request)
        del self.loading[request.request_id]
