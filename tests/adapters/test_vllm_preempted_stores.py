"""Eager mode stores what a preempted request computed in its last step, through vLLM.

The blocks a request computed in the step before its preemption are confirmed only in
the step that preempts it; vLLM has reset the request by then (`_preempt_request`:
`num_computed_tokens = 0`, blocks freed with their keys). kvtier keeps where each
request's last scheduled step ended and stores those blocks before it drops the
request's table (`offload/preempted_stores.py`); a same-step victim's blocks of the step
it was dropped from stay out (test_vllm_priority_victim.py).

Its last step may have scheduled draft tokens it then rejected (speculative decoding):
vLLM rolls `num_computed_tokens` back over them, but that step's end counts them, so the
selection is bounded by the request's last token too (`num_tokens - 1`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import check_quiescent, drain, kvtier_harness, scheduler_side, store_outcomes
from table_mirror import audit_tier
from test_vllm_priority_victim import BLOCK, CONFIG, preempt_in_the_step_that_scheduled_it, tokens
from vllm.v1.request import RequestStatus
from vllm_harness import StepRecord

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


def unhashed(record: StepRecord) -> int:
    """Return the blocks a step's store selection counted as dropped for want of a hash."""
    return store_outcomes(record).get("dropped_unhashed", 0)


def test_a_preempted_requests_rejected_drafts_are_not_walked() -> None:
    """Under vLLM's FCFS policy "a", short of a block, preempts "r" in the step after r's
    last step scheduled its last token (29) and 3 drafts, all rejected: that step ends
    at 33, past a block boundary (32), but r's tokens end at 31. Its preemption's walk
    ends at its last token: vLLM never hashed the block of the rejected drafts, and no
    store outcome counts it (under sync scheduling no full-attention block is unhashed:
    test_vllm_decode_stores.py)."""
    # Mutation check: without the bound by the last token (`state.written_end // unit *
    # unit`), the walk reached block 1 (tokens 16-31, r holds 31): 'assert 1 == 0'.
    # The block is never selected (it has no key), so nothing wrong reaches the tier;
    # vLLM hashes only finalized tokens (`allocate_slots` caps `num_tokens_to_cache`
    # at `request.num_tokens`), so `num_tokens` in place of `num_tokens - 1` is not
    # caught: the block ending at r's last token has no key yet when r is preempted.
    overrides = {"eagle": True, "drafts": 3, "draft_seed": 4, "num_gpu_blocks": 6}
    harness = kvtier_harness(extra={"store_mode": "eager"}, **overrides)
    try:
        harness.add_request("a", tokens(1, 21), max_tokens=40)
        counted = unhashed(harness.step())
        r = harness.add_request("r", tokens(2, 29), max_tokens=40)
        record = harness.step()
        assert record.num_scheduled_tokens == {"a": 4, "r": 29}
        counted += unhashed(record)
        record = harness.step()
        assert record.num_scheduled_tokens["r"] == 4  # its last token (29), 3 drafts
        assert (r.num_tokens, r.num_computed_tokens) == (31, 30)  # every draft rejected
        counted += unhashed(record)
        record = harness.step()
        assert record.scheduler_output.preempted_req_ids == {"r"}
        assert unhashed(record) == 0
        counted += sum(unhashed(record) for record in busy_steps(harness))
        assert counted == 0
        assert harness.finished == {"a", "r"}
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) > 0
        check_quiescent(harness)
    finally:
        harness.close()
