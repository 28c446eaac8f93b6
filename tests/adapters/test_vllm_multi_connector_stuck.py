"""A random-operations example that leaves vLLM stepping forever with kvtier first in a
`MultiConnector` beside SimpleCPUOffload: vLLM 0.33's stale reservations, not kvtier.

Drawn once by `test_vllm_random_ops.explore` on the kvtier-first priority engine of
test_vllm_multi_connector with failed loads among the operations (that test's own
operations leave them out for this reason). The operations fail no load themselves:
four 1-token requests, a 69-token one sharing 3 blocks of family 0, two 53-token ones
sharing the same 3 blocks; the failure is armed last and hits the replay. With vLLM's
GPU cache reset the three long prompts come back from kvtier as one load, which fails.
vLLM 0.33 frees their blocks but keeps all three in `_inflight_prefills`, reserving
their whole recompute (5 + 4 + 4 of the 15 usable blocks) until each is scheduled
again. kvtier offers them no hit (they recompute), but SimpleCPUOffload, asked next,
offers the first its 64-token copy as an asynchronous load, which vLLM admits only
where the free blocks hold every in-flight reservation, its own included, plus the
load: 13 + 5 > 15, never. vLLM's waiting scan stops there for good (test_vllm_multi_
connector's module docstring, docs/vllm.md "failed load"). The record below fails once
vLLM no longer stalls. Without the stale reservations (vLLM patched to count only in-
flight prefills that hold blocks), with SimpleCPUOffload first (it loads, kvtier's
armed failure never fires) and with kvtier alone (its 0 makes vLLM recompute) the same
operations drain, replay and leak nothing, under FCFS and the priority policy.
"""

from __future__ import annotations

import collections
import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from random_ops import Add, Engine, Fail, Step
from random_ops_driver import Run, run_example
from test_vllm_multi_connector import (
    KVTIER_FIRST,
    SIMPLE_FIRST,
    abort_all_and_drain,
    simple_manager,
    stale_reservations,
    stalled,
)
from vllm.v1.core.sched.scheduler import Scheduler

ONE_TOKEN = Add(1, 0, 0, 0, 0, 1)  # an empty prompt: the driver sends [7]
DRAWN = [
    Step(1),
    ONE_TOKEN,
    ONE_TOKEN,
    ONE_TOKEN,
    Step(1),
    ONE_TOKEN,
    Add(1, 0, 3, 21, 0, 1),
    Add(2, 0, 3, 5, 0, 1),
    Step(1),
    Fail("load", 0),
]
POLICIES = ["fcfs", "priority"]
FAILED = ["again-r4", "again-r5", "again-r6"]


@contextlib.contextmanager
def run_of(engine: Engine) -> Iterator[Run]:
    with tempfile.TemporaryDirectory(prefix="kvtier-random-") as disk_dir:
        run = Run(engine, collections.Counter(), disk_dir)
        try:
            yield run
        finally:
            run.close()


def start_replay(run: Run) -> None:
    """Apply `DRAWN`, drain, and add the replay's requests as `Run.replay` does."""
    for op in DRAWN:
        run.apply(op)
    run.finish(abort=False)
    assert run.harness.scheduler.reset_prefix_cache()
    distinct = {tuple(prompt): request_id for request_id, prompt in run.prompts.items()}
    for prompt, request_id in distinct.items():
        run.harness.add_request(f"again-{request_id}", list(prompt), max_tokens=1)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_drawn_example_with_kvtier_first_stalls_vllm(policy: str) -> None:
    engine = Engine("kvtier_first", multi=KVTIER_FIRST, scheduling_policy=policy)
    with run_of(engine) as run:
        start_replay(run)
        assert stalled(run.harness)
        assert run.workers[0].num_failed["load"] == 1
        scheduler: Any = run.harness.scheduler
        assert [r.request_id for r in scheduler.waiting] == FAILED
        assert stale_reservations(run.harness) == dict(zip(FAILED, (5, 4, 4), strict=True))
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15
        assert run.side.offload.loads.recompute_next == set(FAILED)  # kvtier offers 0
        (offered,) = simple_manager(run.harness)._pending_cpu_hits.items()
        assert (offered[0], offered[1][1]) == ("again-r4", 64)  # SimpleCPUOffload's load
        abort_all_and_drain(run.harness)


def count_only_blocks_held(scheduler: Any) -> int:
    """vLLM's in-flight reservation without the prefills that hold no block."""
    return sum(
        scheduler._request_remaining_blocks(request)
        for request in scheduler._inflight_prefills
        if any(scheduler.kv_cache_manager.get_block_ids(request.request_id))
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_drawn_example_drains_without_the_stale_reservations(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Scheduler, "_inflight_prefill_reserved_blocks", count_only_blocks_held)
    totals: collections.Counter[str] = collections.Counter()
    engine = Engine("kvtier_first", multi=KVTIER_FIRST, scheduling_policy=policy)
    run_example(engine, totals, DRAWN, abort=False)
    assert totals["failed_load"] == 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("multi", [SIMPLE_FIRST, None], ids=["simple_first", "alone"])
def test_the_drawn_example_drains_without_kvtier_first(
    multi: tuple[str, str] | None, policy: str
) -> None:
    totals: collections.Counter[str] = collections.Counter()
    run_example(Engine("other", multi=multi, scheduling_policy=policy), totals, DRAWN, False)
    assert totals["failed_load"] == (1 if multi is None else 0)
    assert totals["replay_hit_tokens"] > 0
