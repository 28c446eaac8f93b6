"""Interrupts (Ctrl-C) while the engine hands a step's plan to the worker, or sorts out
a plan the worker refused.

Whatever call the interrupts hit, and however many land, the events the worker never
took are failed (a refused plan's once a flush succeeds): none stays in flight, pinning
its GPU blocks for good.
"""

from __future__ import annotations

from itertools import count
from typing import Any

import pytest
from test_llm_submit_failures import (
    PARAMS,
    RefusingWorker,
    has_stores,
    new_engine,
    prompts,
    serve_the_whole_pool,
)

from kvtier.offload.plan import TransferPlan

MAX_CALLS = 10  # generate calls: each interrupt fails one; a hang fails the test


class InterruptingWorker(RefusingWorker):
    """Refuse the first plan with stores (`error`), then raise KeyboardInterrupt in the
    flushes and polls numbered in `interrupted` (1: the first one after the refusal)."""

    def __init__(self, worker: Any, error: BaseException, interrupted: tuple[int, ...]) -> None:
        super().__init__(worker, has_stores, error)
        self.interrupted = interrupted
        self.num_calls = 0

    def _count(self, name: str) -> None:
        if self.refused is None:
            return
        self.num_calls += 1
        if self.num_calls in self.interrupted:
            raise KeyboardInterrupt(f"Ctrl-C in {name} {self.num_calls}")

    def flush(self) -> None:
        self._count("flush")
        self.worker.flush()

    def poll(self) -> Any:
        self._count("poll")
        return self.worker.poll()


# Calls after the refusal: 1 is the flush in `submit`'s handler; if that one succeeds,
# 2 is the poll that sorts the events; if not, 2 and 3 are the flush and poll retried
# before the next plan.
@pytest.mark.parametrize(
    ("error", "interrupted"),
    [
        *((ValueError("rejected job"), calls) for calls in [(1,), (2,), (3,), (1, 2)]),
        *((ValueError("rejected job"), calls) for calls in [(1, 3), (2, 3), (1, 2, 3)]),
        (ValueError("rejected job"), (2, 3, 4)),
        (KeyboardInterrupt("Ctrl-C in submit"), (2,)),
        (KeyboardInterrupt("Ctrl-C in submit"), (1, 2, 3)),
    ],
    ids=repr,
)
def test_interrupts_while_a_refused_plan_is_sorted_never_strand_it(
    error: BaseException, interrupted: tuple[int, ...]
) -> None:
    # Regression: the events were recorded as owed only once the flush in the handler
    # had failed; a Ctrl-C in the poll after a flush that succeeded (2 without 1) left
    # them in flight for good: their stores pinned GPU blocks, so a request needing the
    # whole pool never fit and `generate` stepped forever.
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = InterruptingWorker(llm.offload.worker, error, interrupted)
    llm.offload.worker = worker
    for offset in count(step=10):
        assert offset < 10 * MAX_CALLS, "generate kept failing"
        arm()
        try:
            llm.generate(prompts(2, 24, offset), PARAMS)
        except (KeyboardInterrupt, ValueError):
            continue
        if worker.num_calls >= max(interrupted):
            break
    assert worker.refused is not None
    serve_the_whole_pool(llm, arm)


def test_a_plan_interrupted_before_its_submit_is_failed_by_the_next_prepare() -> None:
    # Regression: a Ctrl-C between `prepare` and `submit` (say as `submit` starts) left
    # the plan unsubmitted, and the next `prepare` replaced it: its events were never
    # reported (the stores' GPU blocks pinned for good, `generate` stepped forever).
    llm, arm = new_engine()
    offload = llm.offload
    assert offload is not None
    submit = offload.submit
    interrupted: list[TransferPlan] = []

    def interrupted_submit() -> None:
        plan = offload._plan
        if not interrupted and plan is not None and has_stores(plan):
            interrupted.append(plan)
            raise KeyboardInterrupt("Ctrl-C as submit starts")
        submit()

    offload.submit = interrupted_submit  # type: ignore[method-assign]
    arm()
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C as submit starts"):
        llm.generate(prompts(2, 24), PARAMS)
    assert interrupted
    serve_the_whole_pool(llm, arm)
