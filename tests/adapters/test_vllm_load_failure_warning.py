"""The scheduler side's warning for a failed load says what vLLM recomputes.

Regression: it said vLLM "recomputes them from the first block not loaded whole" for
every failure. That holds only where the workers named the bad blocks and the layout
takes errors by block (`invalid_block_ids`); a load failed whole (`failed_recving`),
or any failure on a hybrid layout, has vLLM recompute every token after its own GPU
prefix-cache hit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

pytest.importorskip("vllm")

from faulty_worker import FaultyWorker
from kvtier_vllm import drain, kvtier_harness, offload_worker, zero_blocks
from vllm_engine import KVGroupDef

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.adapters.vllm.worker_side import WorkerSide

PROMPT = list(range(1000, 1065))  # 4 full blocks
WHOLE = "every token after its own GPU prefix-cache hit (the load failed whole)"
BY_BLOCK = "from the first block not loaded whole (the bad blocks were named)"
HYBRID = {"kv_groups": (KVGroupDef(16), KVGroupDef(16, 32)), "num_gpu_blocks": 64}


def failed_load_warnings(
    caplog: pytest.LogCaptureFixture, named: bool, **overrides: Any
) -> tuple[list[str], list[str]]:
    """Store `PROMPT`, fail its load back (one named bad block, or whole); return the
    scheduler side's failed-load warnings, and the worker side's (a request it reported
    in `failed_recving`, whole)."""
    harness = kvtier_harness(**overrides)
    worker = FaultyWorker(offload_worker(harness), zero_blocks(harness))
    harness.add_request("a", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    if named:
        worker.fail_part = 1
    else:
        worker.fail["load"] = 1
    with caplog.at_level(logging.WARNING, logger="kvtier.adapters.vllm"):
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)
        drain(harness)
    harness.close()
    messages = [(r.name.rsplit(".", 1)[-1], r.getMessage()) for r in caplog.records]
    return (
        [m for name, m in messages if name == "scheduler_side" and "failed on a worker" in m],
        [m for name, m in messages if name == "worker_side" and "loads failed" in m],
    )


@pytest.mark.parametrize(
    ("named", "overrides", "recomputed"),
    [(False, {}, WHOLE), (True, {}, BY_BLOCK), (False, HYBRID, WHOLE), (True, HYBRID, WHOLE)],
    ids=["whole", "named", "hybrid-whole", "hybrid-named"],
)
def test_the_failed_load_warning_says_what_vllm_recomputes(
    caplog: pytest.LogCaptureFixture, named: bool, overrides: dict[str, Any], recomputed: str
) -> None:
    (message,), worker_warnings = failed_load_warnings(caplog, named, **overrides)
    assert bool(worker_warnings) == (recomputed == WHOLE)  # as the workers reported it
    assert message.startswith("kvtier load of tokens [0, 64) for request b failed on a worker")
    assert f"vLLM recomputes {recomputed} (kv_load_failure_policy='recompute')" in message


def test_a_named_failure_the_worker_cannot_split_is_whole_on_both_sides(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that gets a load without its parts (`TransferJob.load_parts`: here taken
    off, as from a worker of another build) cannot tell which request read the bad block
    it names, so it fails every request of the event whole (`failed_recving`). Regression:
    its report still named the block, so the scheduler took the failure by block (only
    the readers of it failed; the warning said the bad blocks were named) while vLLM
    recomputed the request whole. The worker now names no block for a failure it
    reported whole, and the scheduler fails the load whole too."""
    original = WorkerSide.bind

    def bind_without_parts(self: WorkerSide, metadata: KVTierMetadata) -> None:
        jobs = tuple(dataclasses.replace(job, load_parts=()) for job in metadata.plan.jobs)
        plan = dataclasses.replace(metadata.plan, jobs=jobs)
        original(self, dataclasses.replace(metadata, plan=plan))

    monkeypatch.setattr(WorkerSide, "bind", bind_without_parts)
    (message,), worker_warnings = failed_load_warnings(caplog, named=True)
    assert worker_warnings  # the worker reported the request failed whole
    assert f"vLLM recomputes {WHOLE} (kv_load_failure_policy='recompute')" in message
