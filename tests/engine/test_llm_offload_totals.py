"""`OffloadSide.totals`: each counter adds up what every poll's stats counted.

A write-back cascade whose disk fails every write: CPU evictions then have no disk copy
(lost blocks), counted in several polls.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from step_watchdog import with_watchdog
from test_llm_cascade_failures import MAX_STEPS, failing_write_back_engine

from kvtier.engine.offload_side import OffloadTotals
from kvtier.engine.sampling import SamplingParams

# Counters `totals` sums over polls (hit_tokens is cumulative already; the events are
# counted by the offload side itself; transfer times are floats).
SUMMED = [
    f.name
    for f in fields(OffloadTotals)
    if f.name.startswith("num_") and f.name not in ("num_issued_events", "num_reported_events")
]


def test_totals_add_up_every_polls_counters(tmp_path: Path) -> None:
    llm = failing_write_back_engine(tmp_path)
    assert llm.offload is not None
    polled: list[Any] = []
    take_stats = llm.offload.scheduler.take_stats

    def taking_stats() -> Any:
        stats = take_stats()
        polled.append(stats)
        return stats

    llm.offload.scheduler.take_stats = taking_stats  # type: ignore[method-assign]
    arm = with_watchdog(llm, MAX_STEPS)
    arm()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(4):
        llm.generate([[(7 * i + t) % 128 for t in range(24)]], params)
    arm()
    llm.drain()
    totals = llm.offload.totals
    for name in SUMMED:
        assert getattr(totals, name) == sum(getattr(s, name) for s in polled), name
    assert sum(s.num_lost_blocks > 0 for s in polled) > 1, "lost blocks in one poll at most"
    llm.shutdown()
