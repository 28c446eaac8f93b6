"""A load that failed naming nothing keeps only the request's local prefix.

The load job is never run and reported failed: every block it was to write holds stale
KV. The request keeps its GPU prefix-cache hit (written by an earlier request) and
recomputes every token from there; its outputs match an engine without offload.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_llm_bad_disk_slot import PARAMS, small_llm

from kvtier.offload.plan import TransferPlan, WorkerReport


class DropFirstLoad:
    """Wrap a worker: the first load job is never run; the next poll fails it."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.dropped: int | None = None
        self.pending: list[int] = []

    def submit(self, plan: TransferPlan) -> None:
        jobs = []
        for job in plan.jobs:
            if self.dropped is None and job.is_load:
                self.dropped = job.event_id
                self.pending.append(job.event_id)
            else:
                jobs.append(job)
        self.worker.submit(TransferPlan(plan.step_id, tuple(jobs), plan.load_request_ids))

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        failed, self.pending = dict.fromkeys(self.pending, 1), []
        return WorkerReport.merge([report, WorkerReport(failed=failed)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def serve(tmp_path: Path | None) -> tuple[list[Any], Any]:
    """Store a 32-token prefix, evict it, serve its first 8 tokens again (a GPU hit for
    the next request), then the whole prefix with a new suffix."""
    rng = random.Random(3)
    prefix = [rng.randrange(128) for _ in range(32)]
    fillers = [[rng.randrange(128) for _ in range(32)] for _ in range(6)]
    with small_llm(tmp_path) as llm:
        llm.generate([prefix], PARAMS)
        for filler in fillers:
            llm.generate([filler], PARAMS)
        llm.drain()
        llm.generate([[*prefix[:8], 1, 2, 3]], PARAMS)
        wrap = None
        if llm.offload is not None:
            wrap = llm.offload.worker = DropFirstLoad(llm.offload.worker)
        outputs = llm.generate([[*prefix, 5, 6, 7]], PARAMS)
        llm.drain()
    return outputs, wrap


def test_a_failed_load_naming_nothing_recomputes_from_the_local_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = serve(None)
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.load_failure"):
        outputs, wrap = serve(tmp_path)
    # Keeps its 2 GPU blocks (old code: "failed: recomputing tokens [8, 32)").
    assert "(tokens [8, 32)) failed: keeping tokens [0, 8), recomputing [8, 32)" in caplog.text
    assert wrap is not None
    assert wrap.dropped is not None, "the prefix was never loaded"
    (output,) = outputs
    assert output.num_external_hit_tokens == 0
    for a, b in zip(reference, outputs, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.logits is not None
        assert b.logits is not None
        assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=0)
