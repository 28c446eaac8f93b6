"""EAGLE-style speculative decoding: a tier hit ends where vLLM's own hits end.

Such a drafter builds a position's draft KV from its hidden state and the next token, so
vLLM recomputes the last block of a prefix hit (`use_eagle_block_drop`), on its GPU hits
and in its own CPU offload connector; kvtier drops it from its tier hits too. Without,
the draft KV of that block's last position held the storing request's next token.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, kvtier_harness, scheduler_side
from vllm_harness import shared_prefix_prompts

from kvtier.adapters.vllm.scheduler_side import (
    SchedulerSide,
    eagle_drop_unit,
    without_last_block,
)


def test_without_last_block() -> None:
    assert without_last_block(0, 48, 16) == 32
    assert without_last_block(16, 32, 16) == 16
    assert without_last_block(16, 16, 16) == 0  # the whole tier hit was the last block
    assert without_last_block(0, 40, 16) == 16  # 40 - 16 = 24, down to a block: 16
    assert without_last_block(0, 40, 8) == 32  # fine-grained: one hash block


@pytest.mark.parametrize("drafter", [True, False], ids=["eagle", "no-drop"])
def test_the_speculative_config_decides_the_drop(drafter: bool) -> None:
    harness = kvtier_harness()
    try:
        side = scheduler_side(harness)
        vllm_config = copy.copy(harness.vllm_config)
        spec = SimpleNamespace(use_eagle_block_drop=lambda: drafter)
        object.__setattr__(vllm_config, "speculative_config", spec)
        eagle = SchedulerSide(vllm_config, harness.kv_cache_config, side.offload.config, [2])
        assert eagle._eagle_drop == (16 if drafter else 0)
        assert eagle_drop_unit(side.layout, fine_grained=True) == side.layout.hash_block_size
    finally:
        harness.close()


def test_an_eagle_engine_loads_all_but_the_last_block_of_the_tier_hit() -> None:
    harness = kvtier_harness()
    side = scheduler_side(harness)
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()  # the GPU copies only
    side._eagle_drop = eagle_drop_unit(side.layout, fine_grained=False)
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)  # the harness checks every loaded position
    # 48 prefix tokens (3 blocks) in the tier: the last block is recomputed.
    assert all(harness.external_hit_tokens(r) == 32 for r in again)
    check_quiescent(harness)
    harness.close()
