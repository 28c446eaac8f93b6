"""`has_pending_block_frees`: vLLM, short of GPU blocks, waits for kvtier's transfers to
hand back the blocks they alone hold instead of preempting a running request.

A finished request's blocks are pinned by its stores until the worker reports them; a
running request that needs a block meanwhile would be preempted (its KV recomputed or
reloaded) although the blocks come back within a step or two.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
)
from vllm_harness import VllmHarness

# 10 usable GPU blocks of 16 tokens. "short" (4 blocks) finishes in its prefill; its
# stores are held, so its 4 blocks stay out of vLLM's free queue. "long" holds 5 blocks
# and decodes: its 7th block does not fit while the stores are held.
SHORT = list(range(1000, 1064))
LONG = list(range(2000, 2080))


def pressed_harness() -> tuple[VllmHarness, PollGate]:
    harness = kvtier_harness(num_gpu_blocks=11, max_num_seqs=2)
    gate = PollGate(offload_worker(harness))
    gate.hold("store")
    harness.add_request("short", SHORT, max_tokens=1)
    harness.add_request("long", LONG, max_tokens=40)
    return harness, gate


def step_while_held(harness: VllmHarness, num_steps: int) -> tuple[int, int]:
    """Step; return the preemptions seen and the steps that scheduled "long"."""
    preempted = scheduled = 0
    for _ in range(num_steps):
        record = harness.step()
        preempted += len(record.scheduler_output.preempted_req_ids or ())
        scheduled += "long" in record.num_scheduled_tokens
    return preempted, scheduled


def test_finished_requests_blocks_held_by_stores_are_pending_frees() -> None:
    harness, gate = pressed_harness()
    connector = harness.scheduler.connector
    harness.step()  # both prefills; "short" finishes, its blocks stay pinned by its stores
    assert "short" in harness.finished
    assert connector.has_pending_block_frees()
    gate.release()
    drain(harness)
    assert not connector.has_pending_block_frees()
    assert harness.finished == {"short", "long"}
    check_quiescent(harness)


def test_running_requests_blocks_held_by_stores_are_not_pending_frees() -> None:
    """A store of a running request's block frees nothing: the request holds it too."""
    harness = kvtier_harness(num_gpu_blocks=11, max_num_seqs=2)
    gate = PollGate(offload_worker(harness))
    gate.hold("store")
    harness.add_request("long", LONG, max_tokens=40)
    for _ in range(3):
        harness.step()
    assert scheduler_side(harness).has_pending_stores(), "long's blocks are being stored"
    assert not harness.scheduler.connector.has_pending_block_frees()
    gate.release()
    drain(harness)
    check_quiescent(harness)


def test_vllm_waits_for_held_blocks_instead_of_preempting() -> None:
    harness, gate = pressed_harness()
    preempted, scheduled = step_while_held(harness, 30)
    assert preempted == 0, "long was preempted while short's stores held its blocks"
    assert scheduled < 30, "long never ran short of blocks: the test proves nothing"
    gate.release()
    drain(harness)
    assert harness.finished == {"short", "long"}
    check_quiescent(harness)


def test_without_it_vllm_preempts_the_running_request() -> None:
    """The same run with `has_pending_block_frees` off preempts (the test above is no
    tautology)."""
    harness, gate = pressed_harness()
    harness.scheduler.connector.has_pending_block_frees = lambda: False  # type: ignore[method-assign]
    preempted, _ = step_while_held(harness, 30)
    assert preempted > 0
    gate.release()
    drain(harness)
    assert harness.finished == {"short", "long"}
    check_quiescent(harness)
