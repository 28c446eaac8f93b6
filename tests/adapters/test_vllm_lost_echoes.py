"""Loads kvtier dropped before issuing them, when the step that echoes them faults.

A request whose load kvtier never issued (here: its lookup pin lost before allocation)
waits in vLLM until every rank echoes it as failed (`KVTierMetadata.
unissued_failed_request_ids`). Under vLLM's fault tolerance the step carrying the echo
may raise inside the connector calls (the output is dropped) or before the plan is even
bound; vLLM then aborts the request but keeps it, and its GPU blocks, until every rank
reported its load. The echo must come in a later step: else the engine never goes idle.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent, drain
from test_vllm_connector_faults import AGAIN, losing_lookup_pins, stored_then_gpu_reset
from test_vllm_fault_tolerance import failed_forward, fault_abort
from test_vllm_skipped_plan import run_on
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

PROMPT = AGAIN["again-req-0"]


def harness_losing_lookup_pins(num_ranks: int) -> VllmHarness:
    """Return a harness whose tier holds the prompts' prefixes, and whose every first
    lookup hit loses its pin before allocation: kvtier drops that load unissued."""
    harness = stored_then_gpu_reset(num_ranks=num_ranks)
    losing_lookup_pins(harness)
    return harness


def finish_and_serve_again(harness: VllmHarness) -> None:
    drain(harness, 300)  # "engine still busy" while vLLM waits for the echo
    check_quiescent(harness)
    harness.add_request("y", [*PROMPT, 4], max_tokens=2)
    drain(harness)
    assert "y" in harness.finished  # its load dropped unissued too: recomputed


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_an_echo_in_a_step_whose_forward_raised_comes_in_the_next(num_ranks: int) -> None:
    harness = harness_losing_lookup_pins(num_ranks)
    harness.add_request("x", PROMPT, max_tokens=3)
    failed_forward(harness)  # its plan echoes x: the output is dropped on every rank
    assert harness.scheduler.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    fault_abort(harness)
    finish_and_serve_again(harness)


@pytest.mark.parametrize(
    ("num_ranks", "num_skipping"), [(1, 1), (2, 2), (2, 1)], ids=["1-rank", "2-ranks", "rank0-of-2"]
)
def test_an_echo_of_a_skipped_plan_comes_from_the_ranks_that_skipped_it(
    num_ranks: int, num_skipping: int
) -> None:
    """The ranks that skipped the plan (vLLM's model runner raised before binding it)
    echo x when they bind the next one; the others' outputs are salvaged by vLLM."""
    harness = harness_losing_lookup_pins(num_ranks)
    harness.add_request("x", PROMPT, max_tokens=3)
    skipped = harness.scheduler.schedule()
    assert skipped.kv_connector_metadata.unissued_failed_request_ids == ("x",)
    salvaged = run_on(harness, range(num_skipping, num_ranks), skipped)
    if salvaged:
        harness._aggregator.ft_defer_kv_connector_outputs(list(salvaged))
    fault_abort(harness)
    finish_and_serve_again(harness)
