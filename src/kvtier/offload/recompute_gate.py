"""Recomputes after failed loads: which lookups answer 0 or None while they wait.

`recompute_next` holds requests whose load failed: their lookups return 0 until the
engine allocates them again, so the retry is a plain recompute. Only requests in
`allocated` (allocated and not finished) are held, so a failure reported after its
request finished leaves nothing behind. Offering a hit again
(from another copy) would make the engine wait for a second load; vLLM 0.33 admits
such a load only beside the blocks reserved for the requests queued behind it, which
may be waiting on the same failed load, and then never makes progress.

While one waits, `offer` turns other requests' hits into None (ask again later) or 0:
vLLM 0.33 keeps reserving a failed request's whole recompute until it runs again,
and admits no load beside that. Each pass of the engine over its queue (`end_pass`
at each plan) looks requests up in its order: a hit looked up after a waiting failed
request waits behind it (None; it keeps the hit). With `recompute_ahead` (the
engine orders its queue by priority) one looked up before every such request
recomputes now (0): it comes first, and waiting for requests behind it would last as
long as they wait, which is while higher-priority requests keep the GPU pool.
Without it (arrival order) that one waits too: only a request preempted after the
failed one was requeued is ahead of it, and the failed request, next in line, runs
once it fits. A failed request's own first lookup after the failure answers None
(`recompute_unasked`): vLLM requeues it behind the requests holding blocks, where
a recompute that does not fit no longer stops its scan before them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable


class RecomputeGate(ABC):
    """The failed-load recompute state of a `LoadPlanner`, over the state its `__init__`
    sets up."""

    recompute_ahead: bool
    recompute_next: set[str]
    recompute_unasked: set[str]
    _recompute_asked: set[str]
    allocated: set[str]

    @abstractmethod
    def release_pin(self, request_id: str) -> None:
        """Drop a request's lookup pin, if any (`LoadPlanner.release_pin`)."""

    def offer(self, request_id: str, num_tokens: int) -> int | None:
        """Return the tokens to offer for the hit its last lookup found: `num_tokens`, 0
        or None (ask again later) while failed requests wait (see the class); the pin
        is released unless the hit is offered."""
        if request_id in self.recompute_unasked:
            self.recompute_unasked.discard(request_id)
            return None  # its lookup returned 0: nothing pinned
        if num_tokens == 0 or not self.recompute_next:
            return num_tokens
        self.release_pin(request_id)
        behind = not self._recompute_asked.isdisjoint(self.recompute_next)
        return None if behind or not self.recompute_ahead else 0

    def end_pass(self) -> None:
        """Forget which failed requests the engine's last pass looked up."""
        self._recompute_asked.clear()

    def note_failed(self, request_ids: Iterable[str]) -> None:
        """Hold the live ones of requests whose load failed in `recompute_next`."""
        live = [r for r in request_ids if r in self.allocated]
        self.recompute_next.update(live)
        self.recompute_unasked.update(live)
