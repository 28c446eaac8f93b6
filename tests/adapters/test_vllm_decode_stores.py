"""Eager stores of decode blocks under each of vLLM's schedulings (SPEC §6.5).

Under asynchronous scheduling vLLM learns a step's sampled tokens, and hashes the blocks
they fill, only when it processes that step's output, one or two steps later. kvtier's
confirmed tokens (`num_computed_tokens - num_output_placeholders`) lag by exactly those
placeholders (at `build_connector_meta` they are the known tokens less one), and vLLM's
`allocate_slots` caches every full block of known tokens before the connector builds its
metadata, so the eager cursor never reaches a full-attention block without a hash. A
cursor passing a block before its hash (counted unhashed) would never come back to it:
this test pins that no decode block is skipped that way. (Unhashed blocks do occur in
sliding-window groups: vLLM never caches the ones no hit can use, `reachable_block_mask`.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import SCHEDULING, check_quiescent, kvtier_harness, scheduler_side, store_outcomes
from vllm_harness import VllmHarness

from kvtier.core.keys import Key, make_key

PROMPT = list(range(7000, 7020))  # 1 full block and 4 tokens
NUM_OUTPUT_TOKENS = 90  # 110 tokens: 6 full blocks of 16, the last token's KV never computed
# vLLM's schedulings, and its synchronous one with an EAGLE config: drafts scheduled every
# step and rolled back (the harness rejects them all; vllm_engine.HarnessConfig.eagle), or
# a fake drafter's, some accepted, the others' positions written with their KV; and its
# drafts under overlapped asynchronous scheduling (placeholders the runner fills).
CONFIGS = {
    **SCHEDULING,
    "sync_eagle": {"eagle": True},
    "sync_drafts": {"eagle": True, "drafts": 3},
    "async_pipelined_drafts": {**SCHEDULING["async_pipelined"], "eagle": True, "drafts": 3},
}


def stored_or_in_flight(harness: VllmHarness, keys: list[Key]) -> list[bool]:
    """Return, per key, whether the tier indexes it or a store of it is queued or in flight."""
    offload = scheduler_side(harness).offload
    index, in_flight = offload.tier_pool.index, offload.selector.in_flight_keys
    return [key in index or key in in_flight for key in keys]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_block_behind_the_eager_cursor_is_stored(config: str) -> None:
    harness = kvtier_harness(**CONFIGS[config])
    request = harness.add_request("long", PROMPT, max_tokens=NUM_OUTPUT_TOKENS)
    selector = scheduler_side(harness).offload.selector
    unhashed = stored = max_cursor = 0
    for record in busy_steps(harness):
        outcomes = store_outcomes(record)
        unhashed += outcomes.get("dropped_unhashed", 0)
        stored += outcomes.get("stored", 0)
        state = selector.tracked.get("long")
        if state is None:
            continue
        cursor = state.cursors[0]
        max_cursor = max(max_cursor, cursor)
        keys = [make_key(h, 0) for h in request.block_hashes[:cursor]]
        assert all(stored_or_in_flight(harness, keys)), f"a block before {cursor} was skipped"
    assert harness.finished == {"long"}
    num_blocks = (len(request.all_token_ids) - 1) // 16
    assert num_blocks == 6
    assert (unhashed, stored) == (0, num_blocks)
    # Eager: every decode block but the last was selected while the request still ran.
    assert max_cursor >= num_blocks - 1
    keys = [make_key(h, 0) for h in request.block_hashes[:num_blocks]]
    assert all(key in scheduler_side(harness).offload.tier_pool.index for key in keys)
    check_quiescent(harness)
