"""A same-step priority victim whose last step rejected draft tokens (speculative decoding).

The harness's fake drafter (`HarnessConfig.drafts`) proposes 3 tokens per decoding step,
some wrong; the forward writes each draft position's KV from the draft it was fed, and
vLLM rolls `num_computed_tokens` back over the rejected ones. After such a step the
request's last token (the bonus token) has no KV yet, and its position holds the KV of
the rejected draft fed there.

Here a low-priority request decodes until its token count reaches a block boundary in a
step that rejected a draft at position 63: vLLM's next `schedule()` schedules it first
and hashes that block (now full of tokens), then a high-priority request short of blocks
preempts it in the same call (test_vllm_priority_victim.py). The block holds the rejected
draft's KV at 63 under the key of the right tokens. Its last scheduled step wrote up to
66 (63 + 3 drafts), but only up to the last token, 63, is right: kvtier must count that
(`PlanAssembler._hold_back_unwritten`), drop the block's key from vLLM's prefix cache and
keep it out of the tier.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from table_mirror import audit_tier
from vllm.v1.request import RequestStatus
from vllm_engine import HarnessConfig, KVMismatchError, PrefixFingerprints
from vllm_harness import VllmHarness

LOW, HIGH = 1, 0  # vLLM runs a lower priority value first
BLOCK = 16
CONFIG = {
    "eagle": True,
    "drafts": 3,
    "num_gpu_blocks": 10,  # 9 usable: the two requests run short at 64 + 47 tokens
    "max_num_batched_tokens": 64,
    "scheduling_policy": "priority",
    "max_num_seqs": 4,
}


def tokens(seed: int, count: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(1000, 30000) for _ in range(count)]


def preempt_after_a_rejected_draft(harness: VllmHarness) -> int:
    """Run the low request until the high one preempts it in the step that scheduled it,
    right after a step that rejected the draft at its last position; return the GPU block
    that held that position (its fourth)."""
    low = harness.add_request("low", tokens(1, 20), max_tokens=80, priority=LOW)
    for _ in range(4):
        harness.step()
    harness.add_request("high", tokens(2, 20), max_tokens=80, priority=HIGH)
    while low.num_tokens < 64:
        assert harness.step().num_scheduled_tokens.keys() == {"low", "high"}
    assert (low.num_tokens, low.num_computed_tokens) == (64, 63)
    block = harness.scheduler.kv_cache_manager.get_block_ids("low")[0][3]
    prints = PrefixFingerprints().upto(low, 64)
    with pytest.raises(KVMismatchError, match="position 63"):  # the rejected draft's KV
        harness.caches[0].check_positions("low", 0, [0, 0, 0, block], prints, range(48, 64))
    record = harness.step()
    # "low" was scheduled first (63 and 3 drafts), then preempted by "high"
    assert record.scheduler_output.preempted_req_ids == {"low"}
    assert record.num_scheduled_tokens.keys() == {"high"}
    assert low.num_computed_tokens == 0
    return block


def test_vllm_caches_the_victims_block_with_the_rejected_drafts_kv() -> None:
    # vLLM alone (no connector): the block's key is cached, its KV wrong at position 63.
    # Should a later vLLM not hash it, kvtier's hold-back has nothing to find: see above.
    harness = VllmHarness(HarnessConfig(**CONFIG))  # type: ignore[arg-type]
    try:
        block = preempt_after_a_rejected_draft(harness)
        low = harness.requests["low"]
        pool = harness.scheduler.kv_cache_manager.block_pool
        found = pool.get_cached_block(low.block_hashes[3], [0])
        assert found is not None
        assert found[0].block_id == block
    finally:
        harness.close()


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_same_step_victims_rejected_draft_kv_is_never_served(mode: str) -> None:
    # Mutation check: without the bound by the last token (min(..., num_tokens - 1)),
    # kvtier left the block's key in vLLM's prefix cache (both modes), and lazy stored
    # it: the tier hit failed with KVMismatchError 'request again-2: position 63 (group
    # 0, block 1, layer 0) holds KV of another prefix'.
    harness = kvtier_harness(extra={"store_mode": mode}, **CONFIG)
    try:
        preempt_after_a_rejected_draft(harness)
        low = harness.requests["low"]
        pool = harness.scheduler.kv_cache_manager.block_pool
        assert pool.get_cached_block(low.block_hashes[3], [0]) is None  # kvtier dropped it
        again = [*low.all_token_ids, *tokens(3, 20)]
        harness.scheduler.finish_requests(["low"], RequestStatus.FINISHED_ABORTED)
        harness.add_request("again-1", again, max_tokens=2)  # the checks read every hit
        drain(harness)
        assert harness.scheduler.reset_prefix_cache()
        harness.add_request("again-2", [*again, 7], max_tokens=2)  # from the tier
        drain(harness)
        assert harness.external_hit_tokens("again-2") >= 48
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) > 0
        check_quiescent(harness)
    finally:
        harness.close()
