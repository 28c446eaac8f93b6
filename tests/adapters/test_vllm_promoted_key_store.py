"""A store whose GPU block vLLM keyed further after kvtier selected it (partial -> full).

In a hybrid model whose full-attention blocks (32 tokens) are larger than the hash block
(16), vLLM keys a block it allocates for a prompt ending inside it under a partial entry
(the prefix to the prompt's last hash block), and promotes that key to the full block's
once the request's tokens fill it (`BlockPool.cache_full_blocks`). kvtier may select such
a block under its partial key: here through a sliding-window block that vLLM freed and
gave to another request's full-attention group, still in kvtier's table of the first
request (the key read is the block's own, so what is stored is right for it). The copy
runs after the step that wrote that key's tokens; the store completes later (a slow
worker: reported 3 polls late). A decoding request with drafts fills the block's
remaining 16 tokens in 4 steps, so by then vLLM has promoted the key: the tier must not
register the copy under the full key, whose last tokens it never held.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from faulty_worker import FaultyWorker
from kvtier_vllm import (
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
    zero_blocks,
)
from random_ops import FAMILIES
from table_mirror import audit_tier
from vllm_engine import KVGroupDef

from kvtier.core.keys import make_key

# Full attention in blocks of 32 beside an 8-token window in blocks of 16.
SMALL_WINDOW = (KVGroupDef(32), KVGroupDef(16, 8))


@pytest.mark.parametrize(
    ("drafts", "hold", "events"),
    [(4, 3, False), (4, 3, True), (0, 20, False)],
    ids=["drafts_reported_3_late", "drafts_events", "reported_20_late"],
)
def test_a_store_completing_after_its_block_was_keyed_further_stores_no_unwritten_kv(
    drafts: int, hold: int, events: bool
) -> None:
    # Regression: the completion registered the key the block had then, the promoted
    # full key: the tier audit failed with KVMismatchError 'CPU slot 3: position 54
    # (group 0, block 3, layer 0) holds KV of another prefix' (with drafts; without,
    # one token a step, at position 48 once the report is 20 polls late).
    harness = kvtier_harness(
        num_cpu_blocks=25,
        num_gpu_blocks=24,
        block_size=16,
        kv_groups=SMALL_WINDOW,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_kv_events=events,  # kvtier registers stores one by one, with their events
        eagle=True,
        drafts=drafts,
        draft_seed=3,  # most drafts right: the request fills 16 tokens in 4 steps
        extra={"store_mode": "eager"},
    )
    try:
        worker = FaultyWorker(offload_worker(harness), zero_blocks(harness))
        worker.delay["store"], worker.hold["store"] = drafts // 2, hold
        for i in range(3):  # one 48-token prompt: its last 16 tokens half a 32-token block
            harness.add_request(f"r{i}", FAMILIES[0][:48], max_tokens=32)
        drain(harness)
        assert worker.num_late > 0
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) >= 5  # every slot holds the KV of its key's tokens
        index = scheduler_side(harness).offload.tier_pool.index
        for request in harness.requests.values():  # stored again under their full keys
            assert make_key(request.block_hashes[3], 0) in index
        check_quiescent(harness)
    finally:
        harness.close()
