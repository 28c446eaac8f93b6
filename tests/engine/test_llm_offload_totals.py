"""`OffloadSide.totals`: each counter adds up what every poll's stats counted.

A write-back cascade whose disk fails every write: CPU evictions then have no disk copy
(lost blocks), counted in several polls.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from step_watchdog import with_watchdog
from test_llm_cascade_failures import MAX_STEPS, failing_write_back_engine
from test_llm_persist_dropped import evict_gpu

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.offload_side import OffloadTotals
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

# Counters `totals` sums over polls (hit_tokens is cumulative already; the events are
# counted by the offload side itself; transfer times are floats).
SUMMED = [
    f.name
    for f in fields(OffloadTotals)
    if f.name.startswith("num_") and f.name not in ("num_issued_events", "num_reported_events")
]


def record_stats(llm: LLM) -> list[Any]:
    """Return the list every poll's stats are appended to from now on."""
    assert llm.offload is not None
    polled: list[Any] = []
    take_stats = llm.offload.scheduler.take_stats

    def taking_stats() -> Any:
        stats = take_stats()
        polled.append(stats)
        return stats

    llm.offload.scheduler.take_stats = taking_stats  # type: ignore[method-assign]
    return polled


def test_totals_add_up_every_polls_counters(tmp_path: Path) -> None:
    llm = failing_write_back_engine(tmp_path)
    assert llm.offload is not None
    polled = record_stats(llm)
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


def test_transfer_bytes_and_seconds_add_up_per_direction() -> None:
    """Each direction's bytes and copy seconds, and the counters, are the sums over every
    poll's stats (a CPU tier: stores in several polls, then loads)."""
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=8 << 20), engine=EngineConfig(block_size=4))
    assert llm.offload is not None
    polled = record_stats(llm)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompts = [[(7 * i + t) % 128 for t in range(24)] for i in range(3)]
    for prompt in prompts:
        llm.generate([prompt], params)
        llm.drain()
    evict_gpu(llm)
    llm.generate(prompts, params)  # loads from the CPU tier
    llm.drain()
    totals = llm.offload.totals
    for name in ("transfer_bytes", "transfer_seconds"):
        summed: dict[str, float] = {}
        for stats in polled:
            for kind, value in getattr(stats, name).items():
                summed[kind] = summed.get(kind, 0) + value
        assert set(summed) == {"GPU_to_CPU", "CPU_to_GPU"}
        assert getattr(totals, name) == pytest.approx(summed), name
    for name in SUMMED:
        assert getattr(totals, name) == sum(getattr(s, name) for s in polled), name
    assert totals.num_bytes_loaded > 0
    timed = [s for s in polled if s.transfer_seconds.get("GPU_to_CPU", 0) > 0]
    assert len(timed) > 1, "stores timed in one poll at most"
    llm.shutdown()
