"""A same-step victim's unwritten blocks are not served back to it when it resumes.

vLLM 0.33 serves a request preempted in the step that scheduled it the blocks of that
step, cached under their keys and never written, as a prefix hit when it resumes, or
to any request with that prompt (test_vllm_priority_victim.py shows vLLM reading them).
kvtier drops those hashes from vLLM's prefix cache in the plan of the step that
preempted it (`BlockPool.evict_blocks`), so the victim recomputes those tokens: vLLM
never reads the blocks, nor computes the blocks after them from that KV, and kvtier's
tier never takes them in (a hit would write nothing: they would hold KV of no prefix).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from table_mirror import audit_tier
from test_vllm_priority_victim import CONFIG, preempt_in_the_step_that_scheduled_it, tokens


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_resumed_victim_reads_none_of_its_unwritten_blocks(mode: str) -> None:
    # Regression: vLLM served the two blocks back as a local hit (blocks 7 and 8 cached
    # under the victim's keys after the step; with that assertion removed, the harness's
    # read check failed with KVMismatchError 'request low: position 112'), and the
    # victim's later blocks were computed from that KV and stored in the tier under
    # their keys (the harness's fake KV depends on the tokens alone: only the read
    # check sees it). Before that, kvtier's lazy walk stored the two blocks themselves
    # once the hit released them ('CPU slot 10: position 112 ... holds KV of another
    # prefix'; eager: the same).
    harness = kvtier_harness(extra={"store_mode": mode}, **CONFIG)
    try:
        assert preempt_in_the_step_that_scheduled_it(harness) == {}
        harness.run()  # the victim resumes: every block it reads was written
        assert "low" in harness.finished
        harness.add_request("same", [*tokens(1, 170), 7], max_tokens=2)
        drain(harness)  # its hits (local or from the tier) hold the victim's written KV
        assert harness.scheduler.reset_prefix_cache()
        assert audit_tier(harness) >= 6
        check_quiescent(harness)
    finally:
        harness.close()
