"""A Ctrl-C in `Scheduler.schedule` right after it preempted a request: the step, and with
it the preemption notice to the offload side (`StepInput.preempted_request_ids`: reset
the request's store tracking, flush before the forward), is lost.

Coverage: the request comes back with its whole table (`TableUpdate.REPLACE`, which
resets its tracking) and every store pins the GPU blocks it reads, so nothing depends on
the notice. Both turns, the second with tier hits on what the first stored, serve the
logits of an engine without offloading, and the drained engine holds no block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from step_watchdog import with_watchdog
from test_llm_poll_interrupts import interrupt_once
from test_llm_queue_move_interrupts import TIGHT, stepped_to_the_end
from test_llm_submit_failures import MAX_STEPS, assert_consistent_and_drained, prompts

from kvtier.engine.llm import LLM
from kvtier.engine.request import Request
from kvtier.offload.config import OffloadConfig, StoreMode

ENGINE = dataclasses.replace(TIGHT, keep_logits=True)
MIB = 1 << 20


def served_logits(llm: LLM, calls: list[list[list[int]]]) -> list[torch.Tensor]:
    """Run `calls` by `step` (each interrupted step called again); return their logits."""
    logits = []
    for call in calls:
        requests: list[Request] = []
        add = llm.add_request

        def adding(prompt: Any, params: Any, add: Any = add, requests: Any = requests) -> Any:
            requests.append(add(prompt, params))
            return requests[-1]

        llm.add_request = adding  # type: ignore[method-assign]
        stepped_to_the_end(llm, call)
        llm.add_request = add  # type: ignore[method-assign]
        logits += [torch.stack(r.kept_logits) for r in requests]
    return logits


@pytest.mark.parametrize("mode", list(StoreMode))
def test_an_interrupt_right_after_a_preemption_loses_its_notice(mode: StoreMode) -> None:
    calls = [prompts(4, 16), [[*p, 9, 8, 7, 6] for p in prompts(4, 16)]]
    expected = served_logits(LLM(None, engine=ENGINE), calls)
    offload = OffloadConfig(cpu_bytes=8 * MIB, store_mode=mode)
    llm = LLM(None, kv_offload=offload, engine=ENGINE)
    arm = with_watchdog(llm, MAX_STEPS)
    arm()
    scheduler = llm.scheduler
    preempt = scheduler._preempt
    interrupted: list[bool] = []

    def preempting(request: Any, step: Any) -> None:
        preempt(request, step)
        interrupt_once(interrupted, f"Ctrl-C right after preempting {request.request_id}")

    scheduler._preempt = preempting  # type: ignore[method-assign]
    got = served_logits(llm, calls)
    assert interrupted == [True], "the interrupt never landed"
    assert llm.offload is not None
    assert llm.stats.num_external_hit_tokens > 0, "the second turn had no tier hit"
    for index, (logits, want) in enumerate(zip(got, expected, strict=True)):
        diff = float((logits - want).abs().max())
        assert diff < 1e-4, f"request {index}: logits off by {diff}"
    assert_consistent_and_drained(llm, arm)
    llm.offload.worker.check_invariants()
    llm.shutdown()
