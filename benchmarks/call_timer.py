"""`CallTimer`: the time spent inside chosen methods of an object, per method, less
what timing one call costs by itself (`clock_overhead_ns`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class CallTimer:
    """Nanoseconds spent inside wrapped methods, per method."""

    clock: Callable[[], int] = time.perf_counter_ns
    overhead_ns: float = 0.0  # what timing one call adds by itself (`clock_overhead_ns`)
    ns: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        """Replace each method of `obj` named in `names` by a timed call of it."""
        for name in names:
            method = getattr(obj, name)
            setattr(obj, name, self._timed(name, method))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock, ns, calls = self.clock, self.ns, self.calls
        ns.setdefault(name, 0)
        calls.setdefault(name, 0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                ns[name] += clock() - start
                calls[name] += 1

        return timed

    def method_ns(self, name: str) -> float:
        """Return the time inside method `name`, less the timing's own cost per call."""
        return max(0.0, self.ns[name] - self.overhead_ns * self.calls[name])

    @property
    def total_ns(self) -> float:
        return sum(self.method_ns(name) for name in self.ns)


def clock_overhead_ns(clock: Callable[[], int]) -> float:
    """Return the ns one timed call of a no-op records: the timing's own cost per call."""
    timer = CallTimer(clock)
    target = SimpleNamespace(noop=lambda: None)
    timer.wrap(target, ("noop",))
    best = float("inf")
    for _ in range(20):
        before = timer.ns["noop"]
        for _ in range(200):
            target.noop()
        best = min(best, (timer.ns["noop"] - before) / 200)
    return best
