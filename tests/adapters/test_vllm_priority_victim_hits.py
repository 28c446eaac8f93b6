"""A same-step victim's unwritten blocks served back to it as a local prefix hit.

vLLM 0.33 serves a request preempted in the step that scheduled it the blocks of that
step, cached under their keys and never written, as a prefix hit when it resumes
(test_vllm_priority_victim.py shows vLLM reading them). That is vLLM's defect; kvtier's
tier must not take those blocks in from there: a hit writes nothing, so they hold KV of
no prefix after it as before, and the tier (a disk tier across restarts) would serve it
to later requests long after vLLM's prefix cache dropped them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from table_mirror import audit_tier
from test_vllm_priority_victim import CONFIG, preempt_in_the_step_that_scheduled_it


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_victims_unwritten_blocks_it_resumes_on_never_reach_the_tier(mode: str) -> None:
    # Regression (lazy): the resumed victim's plan noted its table in use, which released
    # the held-back blocks; freed at its finish, the walk copied them into the CPU tier:
    # the audit failed with KVMismatchError 'CPU slot 10: position 112 (group 0, block
    # 10, layer 0) holds KV of another prefix'. Eager: the same audit failure (the resumed
    # table's hit blocks were selected from position 0).
    harness = kvtier_harness(extra={"store_mode": mode}, **CONFIG)
    try:
        unwritten = preempt_in_the_step_that_scheduled_it(harness)
        for cache in harness.caches:  # vLLM's forward reads the victim's unwritten blocks
            cache.check = lambda *args: None  # type: ignore[method-assign]
        for _ in range(40):  # "high" runs first (eager: store copies in flight hold blocks)
            if "low" in harness.step().num_scheduled_tokens:
                break
        else:
            raise AssertionError("the victim never resumed")
        table = harness.scheduler.kv_cache_manager.get_block_ids("low")[0]
        assert set(unwritten) <= set(table[:10])  # served back as a local hit
        harness.run()
        drain(harness)
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) >= 6
        check_quiescent(harness)
    finally:
        harness.close()
