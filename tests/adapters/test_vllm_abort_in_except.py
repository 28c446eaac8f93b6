"""An abort that vLLM's scheduler sees while an exception is being handled.

`SchedulerSide.on_finished` takes such an abort for vLLM's fault handler
(`fault_tolerant_wrapper` → `EngineCoreSentinel.on_fault`, which aborts every request
after a step raised) and stores nothing of the request: vLLM counted compute it cannot
vouch for. In vLLM 0.33 that is the only abort made in an `except` block: the engine
core's other aborts (client aborts, `abort_immediately`, pause and shutdown in "abort"
mode, a finished streaming session) run from its busy loop or a utility call, and the
front ends' aborts in `except` blocks (`AsyncLLM.generate`) reach the engine core
through a queue. Only an application driving an in-process engine core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `LLMEngine.abort_request`) from its own `except`
block is taken for a fault it is not. Then the request's blocks are neither stored at
its finish nor by the lazy walk (held back until a request uses them again): a missed
hit, never wrong KV, and nothing is held.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from test_vllm_fault_before_bind import num_tier_blocks
from vllm.v1.request import RequestStatus

PROMPT = list(range(5000, 5065))  # 4 full blocks and a partial one


class AppError(Exception):
    """An application's own error, handled by aborting its request."""


@pytest.mark.parametrize("in_except", [False, True], ids=["plain", "in-except"])
def test_an_abort_in_an_except_block_only_misses_the_requests_stores(in_except: bool) -> None:
    harness = kvtier_harness(extra={"store_mode": "lazy"})
    harness.add_request("x", PROMPT, max_tokens=50)
    for _ in range(3):  # x's prefill and two decode steps
        harness.step()
    assert harness.scheduler.requests["x"].num_computed_tokens > 64
    if in_except:
        try:
            raise AppError("the application's own failure")
        except AppError:
            harness.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    else:
        harness.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    drain(harness)
    check_quiescent(harness)
    stored = num_tier_blocks(harness)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    harness.add_request("y", [*PROMPT, 1], max_tokens=2)
    drain(harness)  # the harness checks every block's KV
    assert harness.external_hit_tokens("y") == (0 if in_except else 64)
    assert stored == (0 if in_except else 4)
    check_quiescent(harness)
