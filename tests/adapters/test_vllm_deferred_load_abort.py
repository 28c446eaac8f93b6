"""A request aborted while its load is allocated but not yet issued.

vLLM 0.33 defers an async load's `update_state_after_alloc` to `update_from_output`
(`Scheduler._drain_deferred_loads`) when `defer_async_loads` is set (overlapped steps, a
KV consumer, HiSparse), so kvtier queues the load between two steps. An abort before the
next `build_connector_meta` drops it (SPEC §6.7: nothing not yet issued is kept), yet
vLLM frees a request waiting for its load only once the load is reported: kvtier echoes
it as never issued (regression: vLLM held the request and stepped forever).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import SCHEDULING, check_quiescent, drain, kvtier_harness, scheduler_side
from vllm.v1.request import RequestStatus
from vllm_harness import shared_prefix_prompts


def test_an_abort_before_a_deferred_load_is_issued_frees_the_request() -> None:
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    scheduler = harness.scheduler
    prompt = shared_prefix_prompts(1, prefix_len=48, suffix_len=5)["req-0"]
    harness.run_requests({"a": prompt}, max_tokens=3)
    assert scheduler.reset_prefix_cache()  # the next request hits the tier only
    scheduler.defer_async_loads = True  # HiSparse's (`kv_cache_config.hisparse_host_num_blocks`)
    harness.add_request("c", list(range(2000, 2100)), max_tokens=40)  # keeps steps in flight
    harness.step()
    harness.add_request("b", [*prompt, 9], max_tokens=3)
    side = scheduler_side(harness)
    on_allocated = side.on_allocated
    deferred: list[int] = []

    def allocated(request: Any, block_ids: Any, num_external: int) -> Any:
        if num_external:
            deferred.append(num_external)
        return on_allocated(request, block_ids, num_external)

    side.on_allocated = allocated  # type: ignore[method-assign]
    for _ in range(20):
        harness.step()
        if deferred:
            break
    assert deferred == [48], "b's load was not allocated"
    assert [load.request_id for load in side.offload.loads.queued] == ["b"], "not deferred"
    assert scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # between two steps
    drain(harness, max_steps=300)
    assert "b" not in scheduler.requests, "vLLM still holds the aborted request"
    check_quiescent(harness)
