"""Restarts of a persistent disk tier under random transfer failures: a restart restores
only (slot, key) pairs the offload scheduler held when the run before shut down.

Each seed picks disk-only or CPU+disk (either cascade mode) and the token check, and runs
three engines on one directory; in the first two, jobs fail at random (not run, or run
and reported failed, as when another worker failed them). Regression: the manifest kept
the records of copies the scheduler had dropped (failed loads' suspects, unregistered
demotions, failed writes), and restarts restored them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from test_llm_persist_dropped import BLOCK_BYTES, ENGINE, MODEL, Faults, disk_copies, evict_gpu

from kvtier.core.keys import Key
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import TransferPlan, WorkerReport

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


class RandomFaults(Faults):
    """Fail a job with probability `p` (not run), or run it and report it failed (p/2)."""

    def __init__(self, worker: Any, rng: random.Random, p: float) -> None:
        super().__init__(worker)
        self.fail = lambda job: rng.random() < p
        self.rng, self.p = rng, p
        self.lie: set[int] = set()

    def submit(self, plan: TransferPlan) -> None:
        self.lie.update(job.event_id for job in plan.jobs if self.rng.random() < self.p / 2)
        super().submit(plan)

    def peek(self) -> WorkerReport:
        report = super().peek()
        lied = {e: n for e, n in report.done.items() if e in self.lie}
        if not lied:
            return report
        done = {e: n for e, n in report.done.items() if e not in lied}
        return WorkerReport(done=done, failed={**report.failed, **lied}, seconds=report.seconds)


@pytest.mark.parametrize("seed", [13, 15, 16])
def test_a_restart_restores_only_what_the_scheduler_held(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    cascade = rng.random() < 0.6
    mode = rng.choice(list(CascadeMode))
    check = rng.random() < 0.5
    prefixes = [[rng.randrange(120) for _ in range(16)] for _ in range(4)]
    held: set[tuple[int, Key]] = set()
    for run in range(3):
        config = OffloadConfig(
            cpu_bytes=6 * BLOCK_BYTES if cascade else 0,
            disk_bytes=24 * BLOCK_BYTES,
            disk_path=str(tmp_path),
            disk_io_mode=DiskIOMode.PAGE_CACHE,
            disk_persist=True,
            cascade=mode,
            token_check=check and run > 0,
        )
        llm = LLM(MODEL, kv_offload=config, engine=ENGINE)
        restored = disk_copies(llm)
        assert restored <= held, f"run {run}: restored {len(restored - held)} pairs not held"
        assert llm.offload is not None
        faults = RandomFaults(llm.offload.worker, rng, 0.15 if run < 2 else 0.0)
        llm.offload.worker = faults  # type: ignore[assignment]
        try:
            for _ in range(12):
                prompt = rng.choice(prefixes)[: 4 * rng.randint(1, 4)]
                prompt += [rng.randrange(120) for _ in range(rng.randrange(1, 5))]
                llm.generate([prompt], PARAMS)
                if rng.random() < 0.5:
                    evict_gpu(llm)
        finally:
            llm.shutdown()
        held = disk_copies(llm)
