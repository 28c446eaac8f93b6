"""A failed forward's blocks are not served as prefix hits by vLLM's own cache.

Under vLLM's fault tolerance a step whose forward raised leaves its blocks unwritten,
but vLLM 0.33 hashed them when it scheduled them and keeps those hashes when the fault
handler aborts every request: without kvtier, the next request with that prompt takes
them as a local prefix hit and reads KV never written. kvtier is told the aborted
requests' compute is unconfirmed (`on_finished(computed=False)`) and drops their
blocks' hashes from vLLM's prefix cache, so the request recomputes instead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain, kvtier_harness
from test_vllm_fault_tolerance import PROMPT, failed_forward, fault_abort
from vllm_engine import HarnessConfig, KVMismatchError
from vllm_harness import VllmHarness


def fail_the_prefill_of(harness: VllmHarness) -> None:
    """Leave another request's KV in the GPU blocks, then fail the forward of a prefill
    of `PROMPT` into them and abort every request as vLLM's fault handler does."""
    harness.add_request("c", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    harness.add_request("a", PROMPT, max_tokens=4)
    failed_forward(harness)
    fault_abort(harness)


@pytest.mark.parametrize(("num_ranks", "store_mode"), [(1, "eager"), (2, "eager"), (1, "lazy")])
def test_a_failed_forwards_blocks_are_not_served_as_local_hits(
    num_ranks: int, store_mode: str
) -> None:
    # Regression: vLLM served a's 4 unwritten blocks to b as a 64-token local hit; the
    # harness's read check failed with KVMismatchError 'request b: position 0 (group 0,
    # block 5, layer 0) holds KV of another prefix' (kvtier stored none of them).
    harness = kvtier_harness(num_ranks=num_ranks, extra={"store_mode": store_mode})
    try:
        fail_the_prefill_of(harness)
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)  # no reset of vLLM's cache
        drain(harness)
        assert harness.local_hit_tokens("b") == 0
        assert harness.external_hit_tokens("b") == 0
        harness.add_request("b2", [*PROMPT, 8], max_tokens=2)
        drain(harness)  # b's blocks are written: served now
        assert harness.local_hit_tokens("b2") == 64
        check_quiescent(harness)
    finally:
        harness.close()


def test_vllm_serves_a_failed_forwards_blocks_as_local_hits() -> None:
    # vLLM's defect without kvtier (no connector here). Should a later vLLM drop those
    # hashes at the fault, this fails: update docs/vllm.md ("Fault tolerance").
    harness = VllmHarness(HarnessConfig())
    try:
        fail_the_prefill_of(harness)
        harness.add_request("b", [*PROMPT, 7], max_tokens=2)
        with pytest.raises(KVMismatchError, match="request b: position 0"):
            drain(harness)
    finally:
        harness.close()
