"""A failed forward's block keyed inside it (fine-grained prefix hits) is not served.

With `prefix_match_unit` finer than a hybrid model's blocks, vLLM 0.33 keys the block
holding a prompt's tail at its last hash boundary inside the block
(`FullAttentionManager._cache_partial_tail_block`) when it schedules the tokens, before
any forward writes them. A failed forward leaves that key on a block partly unwritten,
and vLLM would serve it to a later request of the same prompt as a partial hit, by
copy-on-write into a fresh block (`kv_cache_block_copies`): the copy holds the unwritten
positions, and the request computes on from them. kvtier drops every key of the failed
request's blocks from vLLM's prefix cache, the partial one too (vLLM keeps it among a
block's other hashes, `cached_block_hashes_by_block`): the request recomputes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import ForwardFaults
from kvtier_vllm import SCHEDULING, check_quiescent, drain, kvtier_harness
from table_mirror import audit_tier
from vllm_engine import KVGroupDef

UNIT = 16
PROMPT = list(range(1000, 1056))  # 56 tokens: the tail's key ends at 48, inside block 1


@pytest.mark.parametrize(
    ("mode", "scheduling"),
    [("eager", "sync"), ("eager", "async"), ("lazy", "sync"), ("lazy", "async")],
)
def test_a_failed_forwards_partly_keyed_block_is_not_served(mode: str, scheduling: str) -> None:
    # Regression (found by a review helper, as the copy reaching the tier): vLLM served
    # a's block 1 as a 48-token partial hit, copied; the harness's read check failed
    # with KVMismatchError 'request s: position 32 (group 0, block 10, ...) holds KV of
    # another prefix', and the copy, filled by the request, was stored (tier audit
    # 'CPU slot 8: position 32 (group 0, block 7, layer 0) holds KV of another prefix').
    harness = kvtier_harness(
        extra={"store_mode": mode},
        kv_groups=(KVGroupDef(32), KVGroupDef(32, mamba=True)),
        block_size=32,
        prefix_match_unit=UNIT,
        num_gpu_blocks=24,
        max_num_batched_tokens=40,
        **SCHEDULING[scheduling],
    )
    faults = ForwardFaults(harness)
    try:
        harness.add_request("c", list(range(5000, 5130)), max_tokens=2)
        drain(harness)  # c's KV is left in the GPU blocks the next requests get
        harness.add_request("a", PROMPT, max_tokens=4)
        # Mamba's "align" mode ends a chunk on a block: block 0 is written, then the
        # failed step keys block 1 at the prompt's last hash boundary (48), unwritten.
        assert harness.step().num_scheduled_tokens == {"a": 32}
        assert faults.fail_step(None)  # vLLM's engine core then aborts every request
        harness.add_request("s", [*PROMPT, *range(2000, 2020)], max_tokens=8)
        drain(harness)  # the harness checks every position the request reads
        assert harness.admissions["s"] == (0, 0)  # a's whole table lost its keys
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) >= 2
        check_quiescent(harness)
    finally:
        harness.close()
