"""Eager mode's stores of a preempted request's last step after a failed kvtier load, through vLLM.

Requests take tier hits whose loads fail (`PollGate.fail_loads` zeroes the GPU blocks:
the copy half landed); under vLLM's recompute policy they recompute from there, and a
GPU pool too small for all of them preempts some mid-prefill or mid-decode. Eager mode
stores what a preempted request computed in its last step (`preempted_stores`); a block
the failed load left unwritten must never reach the tier under its key: the tier audit
reads every block the tier indexes. Variants: vLLM's async scheduling, and load reports
held back for the first steps (requests wait longer with loads in flight).

kvtier's loads are vLLM async loads (`get_num_new_matched_tokens` answers load_async),
so vLLM reports a failed one while the request still waits for it (`_handle_invalid_blocks`'s
async branch: its blocks are not cached yet), and preempts only running requests. In
0.33, then, a request is never preempted with a kvtier load in flight (asserted below),
and when its load fails it has no last step noted yet (it is noted afresh when vLLM
schedules it to recompute): `forget_last_step` and the in-flight skip guard paths these
runs do not reach, and the tests pass without them. They pin the end-to-end outcome.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
    zero_blocks,
)
from table_mirror import audit_tier
from vllm_harness import VllmHarness, shared_prefix_prompts

PROMPTS = shared_prefix_prompts(3, prefix_len=64, suffix_len=3, num_prefixes=3)
# the same prefixes, longer: a tier hit of 4 blocks each, then 40 tokens to compute
AGAIN = {
    f"again-{r}": [*p[:64], *range(500 + i, 540 + i)] for i, (r, p) in enumerate(PROMPTS.items())
}
CONFIG = {
    "num_gpu_blocks": 14,  # 13 usable: two of the longer requests at a time, not three
    "max_num_batched_tokens": 64,
    "long_prefill_token_threshold": 24,
    "max_num_seqs": 4,
}


def run_failing_loads(async_scheduling: bool, hold_loads: bool) -> VllmHarness:
    """Store the prompts' prefixes, reset vLLM's cache, then run longer prompts whose
    tier loads all fail, on a pool that preempts; return the harness (run to the end,
    vLLM's prefix cache reset) after checking loads failed and requests were preempted."""
    harness = kvtier_harness(
        extra={"store_mode": "eager"}, async_scheduling=async_scheduling, **CONFIG
    )
    harness.run_requests(PROMPTS, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    gate = PollGate(offload_worker(harness))
    gate.fail_loads(zero_blocks(harness))
    if hold_loads:
        gate.hold("load")
    loading = scheduler_side(harness).offload._book.load_request_ids
    preempted: list[str] = []
    preempted_loading: list[str] = []
    loaded: set[str] = set()  # requests a load (all fail) was issued for
    for request_id, prompt in AGAIN.items():
        harness.add_request(request_id, prompt, max_tokens=24)
    for step in range(400):
        if not harness.scheduler.has_requests():
            break
        if hold_loads and step == 6:
            gate.release()
        in_flight = {r for ids in loading().values() for r in ids}
        record = harness.step()
        loaded |= in_flight | {r for ids in loading().values() for r in ids}
        now = set(record.scheduler_output.preempted_req_ids or ())
        preempted += sorted(now)
        preempted_loading += sorted(now & in_flight)
    drain(harness)
    assert harness.finished >= set(AGAIN)
    assert gate.num_failed_loads >= len(AGAIN)  # every hit offered, loaded, failed
    assert all(harness.external_hit_tokens(r) == 64 for r in AGAIN)
    assert loaded & set(preempted)  # preempted after its load failed
    assert not preempted_loading  # vLLM preempts running requests only
    assert harness.scheduler.reset_prefix_cache()
    gate.stop_failing_loads()  # the audit's own loads
    return harness


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("hold_loads", [False, True], ids=["reported", "held"])
def test_a_failed_loads_blocks_never_reach_the_tier_from_a_preempted_request(
    async_scheduling: bool, hold_loads: bool
) -> None:
    harness = run_failing_loads(async_scheduling, hold_loads)
    try:
        # KVMismatchError if a zeroed block (or one computed on it) were stored
        assert audit_tier(harness) >= 3 * 4
        check_quiescent(harness)
    finally:
        harness.close()
