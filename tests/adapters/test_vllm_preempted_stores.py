"""Eager mode stores what a preempted request computed in its last step, through vLLM.

The blocks a request computed in the step before its preemption are confirmed only in
the step that preempts it; vLLM has reset the request by then (`_preempt_request`:
`num_computed_tokens = 0`, blocks freed with their keys). kvtier keeps where each
request's last scheduled step ended and stores those blocks before it drops the
request's table (`offload/preempted_stores.py`); a same-step victim's blocks of the step
it was dropped from stay out (test_vllm_priority_victim.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness, scheduler_side
from table_mirror import audit_tier
from test_vllm_priority_victim import BLOCK, CONFIG, preempt_in_the_step_that_scheduled_it
from vllm.v1.request import RequestStatus

from kvtier.core.keys import make_key


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preempted_requests_last_step_reaches_the_tier(async_scheduling: bool) -> None:
    # Regression: "low" computed tokens 64-112 (blocks 4-6) in the step before the one
    # that preempted it; its table was reset before they were selected, and none of
    # them reached the tier (stored: [True, True, True, True, False, False, False]).
    overrides = dict(CONFIG, async_scheduling=async_scheduling)
    harness = kvtier_harness(extra={"store_mode": "eager"}, **overrides)
    try:
        assert preempt_in_the_step_that_scheduled_it(harness) == {}  # keys dropped
        low = harness.requests["low"]
        harness.scheduler.finish_requests(["low"], RequestStatus.FINISHED_ABORTED)
        drain(harness)
        index = scheduler_side(harness).offload.index
        stored = [
            index.first.cached_block(make_key(low.block_hashes[i], 0)) is not None
            for i in range(160 // BLOCK)
        ]
        assert stored == [True] * 7 + [False] * 3  # 7, 8: the dropped step's, unwritten
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) >= 9  # low's 7 computed blocks, high's 2
        check_quiescent(harness)
    finally:
        harness.close()
