"""A request aborted while its step is in flight, before that step's forward fails, on a
Mamba hybrid whose blocks span several hash blocks (vLLM's `prefix_match_unit`).

vLLM 0.33 ends the prefill chunk of such a request at its prompt's last hash boundary
inside a block and keys that block under the partial hash of the boundary (a "partial
tail": `test_vllm_mamba_coarse.py`). When the fault handler's abort takes the user's
abort as unconfirmed (`SchedulerSide._unconfirm_finishes`), the aborted request's blocks
are still referenced (vLLM defers their frees behind the failed step), so they are told
from blocks given to other requests since by their keys (`hold_back_unconfirmed`,
`finished_earlier`). The partial tail's key is not the whole block's: it passed for
another request's block, kept its key and was not held back. Found by a fuzzing
helper (its pipelined-fault operation: a fault with steps in flight on either side).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees
from kvtier_vllm import check_quiescent, drain
from table_mirror import audit_tier
from test_vllm_fault_tolerance import apply_output, fault_abort, launch, raising_forward
from test_vllm_mamba_coarse import FILLERS, PROMPTS, coarse_harness
from vllm.v1.request import RequestStatus

PROMPT = PROMPTS["req-0"]  # 104 tokens: the chunk ends at 96, inside block 1


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_the_partial_tail_of_a_request_aborted_before_the_fault_is_held_back(
    store_mode: str,
) -> None:
    harness = coarse_harness(
        store_mode, async_scheduling=True, batch_queue_size=3, max_num_batched_tokens=256
    )
    try:
        harness.add_request("c", PROMPTS["req-1"], max_tokens=2)  # another prefix
        drain(harness)  # c's KV is left in the GPU blocks the next requests get
        harness.add_request("x", list(range(9000, 9020)), max_tokens=50)
        harness.add_request("a", PROMPT, max_tokens=4)
        step_n = launch(harness)  # a's block 0, hashed, not written
        step_after = launch(harness)  # a's block 1 up to 96 tokens: its partial tail
        harness.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # no fault yet
        with pytest.raises(RuntimeError, match="forward failed"):
            raising_forward(harness, step_n)
        (kv_output,) = [worker.after_forward(step_after) for worker in harness.workers]
        fault_abort(harness)  # x is still running: its abort unconfirms a's finish
        drain_deferred_frees(harness)  # the failed step is never processed
        harness.wait_for_copies()
        apply_output(harness, kv_output)
        harness.add_request("d", FILLERS["req-0"], max_tokens=2)
        drain(harness)  # d's steps: a lazy walk passes a's freed blocks
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)
        drain(harness)  # KVMismatchError if vLLM or kvtier serves a's unwritten blocks
        assert harness.local_hit_tokens("b") == 0
        assert harness.external_hit_tokens("b") == 0
        assert harness.scheduler.reset_prefix_cache()
        audit_tier(harness)  # every slot holds its key's KV
        check_quiescent(harness)
    finally:
        harness.close()
