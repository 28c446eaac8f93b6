"""How vLLM 0.33's multiproc executor hands the engine core a step whose forward raised
on one rank of two, with a batch queue (asynchronous scheduling, a pipeline), and what
that leaves kvtier.

Both model runners return a forward's connector output from `sample_tokens`
(`execute_model` returns None once the forward ran), so the executor salvages nothing
when a rank's `execute_model` raises; the step's `sample_tokens` was already sent, and
the failing rank answers it with an empty output under Model Runner V1
(`EMPTY_MODEL_RUNNER_OUTPUT`: no `execute_model_state`) and with None under V2. The
canaries below pin vLLM's half of that (`KVOutputAggregator.aggregate`,
`Scheduler.update_from_output`); should a later vLLM change it, update docs/vllm.md
("Fault tolerance").
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from forward_faults import raise_from_forward, rank_reply
from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
)
from test_vllm_connector_faults import AGAIN, losing_lookup_pins, stored_then_gpu_reset
from test_vllm_fault_tolerance import fault_abort, launch
from test_vllm_skipped_plan import run_on
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness


def healthy_reply() -> ModelRunnerOutput:
    """A healthy rank's `sample_tokens` reply: one sampled token, a finished load."""
    reply = rank_reply()
    reply.req_ids, reply.req_id_to_index, reply.sampled_token_ids = ["r"], {"r": 0}, [[7]]
    reply.kv_connector_output = KVConnectorOutput(finished_recving={"x"})
    return reply


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_vllm_v1_aggregates_a_failed_step_s_replies_without_error(failing_rank: int) -> None:
    # V1: the failing rank's empty reply is a success; the aggregate is the output
    # rank's reply (rank 0 here) with the healthy rank's connector output merged in.
    replies = [healthy_reply(), healthy_reply()]
    replies[failing_rank] = rank_reply()
    aggregated = KVOutputAggregator(expected_finished_count=2).aggregate(replies)
    assert aggregated is not None
    assert aggregated.req_ids == ([] if failing_rank == 0 else ["r"])
    kv_output = aggregated.kv_connector_output
    assert kv_output is not None
    assert kv_output.finished_recving is None  # counted once: 1 of 2 ranks


def test_vllm_v2_drops_a_failed_step_s_replies() -> None:
    # V2: None from the failing rank; as the output rank the aggregate is None (the
    # engine core then raises the `execute_model` error), else an AssertionError.
    aggregator = KVOutputAggregator(expected_finished_count=2)
    assert aggregator.aggregate([None, healthy_reply()]) is None
    with pytest.raises(AssertionError):
        aggregator.aggregate([healthy_reply(), None])


def test_vllm_raises_key_error_applying_an_empty_output_to_a_running_request() -> None:
    # V1, the failing rank the output rank: `update_from_output` raises at the first
    # request still running (a fault for the engine core), after the aggregator counted
    # the healthy rank's connector output and before vLLM hands it to the connector.
    harness = kvtier_harness(**SCHEDULING["async_pipelined"])
    try:
        harness.add_request("r", list(range(9000, 9020)), max_tokens=50)
        step = launch(harness)
        with pytest.raises(KeyError, match="r"):
            harness.scheduler.update_from_output(step, rank_reply())
    finally:
        harness.close()


def load_reports_around_a_fault(
    harness: VllmHarness, failing_rank: int, runner: str, output_rank: int, early_rank: int | None
) -> PollGate:
    """`b` waits for its load, `r` runs; `early_rank`'s report of b's load (if any) is
    applied before step N, the other healthy rank's comes with N, whose forward raises on
    `failing_rank` under `runner` ("v1": an empty reply, "v2": None); the engine core
    faults and aborts every request (V1: `update_from_output` raises KeyError after the
    aggregator counted the healthy rank's report; V2: the aggregate fails first). Four
    steps follow; returns the failing rank's gate (still holding unless `early_rank`)."""
    harness.add_request("x", list(range(5000, 5065)), max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    gates = [PollGate(offload_worker(harness, rank)) for rank in range(2)]
    for gate in gates:
        gate.hold("load")
    harness.add_request("r", list(range(9000, 9020)), max_tokens=50)
    for _ in range(4):
        harness.step()
    harness.add_request("b", [*range(5000, 5065), 7], max_tokens=4)
    harness.step()
    harness.wait_for_copies()
    while harness._in_flight:
        harness._complete(*harness._in_flight.popleft())
    assert harness.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if early_rank is not None:
        gates[early_rank].release()
        harness.step()
        while harness._in_flight:  # the rank's report of b is applied: b 1 of 2
            harness._complete(*harness._in_flight.popleft())
    gates[1 - failing_rank].release()  # the healthy rank's report comes with N
    step_n = launch(harness)
    replies: list[ModelRunnerOutput | None] = []
    for rank, worker in enumerate(harness.workers):
        if rank == failing_rank:
            raise_from_forward(worker, step_n, v2=runner == "v2")
            replies.append(None if runner == "v2" else rank_reply())
        else:
            kv_output = worker.after_forward(step_n)
            replies.append(rank_reply(kv_output))
    try:  # vLLM's `fault_tolerant_wrapper` → `on_fault` on any of these
        aggregated = harness._aggregator.aggregate(replies, output_rank=output_rank)
        if aggregated is None:
            raise RuntimeError("One or more workers failed")  # the `execute_model` future's
        harness.scheduler.update_from_output(step_n, aggregated)
    except (KeyError, AssertionError, RuntimeError):
        harness.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    else:
        raise AssertionError("the step's fault went unnoticed")
    for _ in range(4):
        step = launch(harness)
        outputs = [rank_reply(worker.after_forward(step)) for worker in harness.workers]
        aggregated = harness._aggregator.aggregate(outputs, output_rank=output_rank)
        assert aggregated is not None
        harness.scheduler.update_from_output(step, aggregated)
    return gates[failing_rank]


def finish_the_load(harness: VllmHarness, gate: PollGate) -> None:
    """Let the held rank report b's load; vLLM then frees b's blocks, leaking nothing."""
    gate.release()
    drain(harness)
    assert "b" not in harness.scheduler.requests
    check_quiescent(harness)


@pytest.mark.parametrize(
    ("failing_rank", "runner", "output_rank"),
    [(1, "v1", 1), (0, "v1", 0), (1, "v2", 1), (1, "v2", 0)],
    ids=["v1_last_stage", "v1_tensor_parallel", "v2_last_stage", "v2_tensor_parallel"],
)
def test_a_load_is_not_finished_for_vllm_before_every_rank_reported_it(
    failing_rank: int, runner: str, output_rank: int
) -> None:
    # Was (V1): the healthy rank's output of N was counted by `KVOutputAggregator` (b: 1
    # of 2) but never reached kvtier (the KeyError came first), so that rank sent it
    # again once every rank's outputs of a later step were applied (`redelivery`): the
    # aggregator counted b a second time and vLLM freed b's blocks while the failing
    # rank's copy into them was still unreported (on a GPU it may still be writing them).
    # V2 counts nothing of N: the report sent again is its first.
    harness = kvtier_harness(num_ranks=2, **SCHEDULING["async_pipelined"])
    try:
        held = load_reports_around_a_fault(harness, failing_rank, runner, output_rank, None)
        assert "b" in harness.scheduler.requests
        finish_the_load(harness, held)
    finally:
        harness.close()


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_load_finished_in_an_aggregate_vllm_never_applied_is_finished(failing_rank: int) -> None:
    # Was: the failing rank reported b before N, the healthy rank in N: the aggregate of
    # N listed b (its count's last report) but the KeyError dropped it, and the healthy
    # rank's report sent again started a new count vLLM never completed: b's blocks were
    # held for good ('b' still in vLLM's requests).
    harness = kvtier_harness(num_ranks=2, **SCHEDULING["async_pipelined"])
    try:
        load_reports_around_a_fault(harness, failing_rank, "v1", failing_rank, failing_rank)
        assert "b" not in harness.scheduler.requests
        check_quiescent(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_an_echo_finished_in_an_aggregate_vllm_never_applied_is_finished(failing_rank: int) -> None:
    # As above, for a load kvtier never issued (echoed as failed, `_echo_failed`): the
    # healthy rank skipped the plan echoing x (raised before binding it; V1 answers with
    # an empty reply, and the engine core applies the output rank's, reading the
    # `execute_model` error only after a None), so its echo comes with N; the failing
    # rank's was applied before. A worker leaving its echoes out of the requests it names
    # (`recving`, mutant m54b of 7a3a610) left kvtier's count of x at the redelivered
    # report: x and its GPU blocks held for good.
    harness = stored_then_gpu_reset(num_ranks=2, **SCHEDULING["async_pipelined"])
    try:
        losing_lookup_pins(harness)
        drain(harness)
        harness.add_request("x", AGAIN["again-req-0"], max_tokens=3)
        step_s = harness.scheduler.schedule()  # bound by the failing rank only
        assert step_s.kv_connector_metadata.unissued_failed_request_ids == ("x",)
        replies = [rank_reply() for _ in range(2)]
        (kv_output,) = run_on(harness, range(failing_rank, failing_rank + 1), step_s)
        replies[failing_rank] = rank_reply(kv_output)
        aggregated = harness._aggregator.aggregate(replies, output_rank=failing_rank)
        assert aggregated is not None
        harness.scheduler.update_from_output(step_s, aggregated)  # x: 1 of 2
        assert harness.scheduler.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        harness.add_request("r", list(range(9000, 9020)), max_tokens=50)
        step_n = launch(harness)
        replies = [rank_reply() for _ in range(2)]
        for rank, worker in enumerate(harness.workers):
            if rank == failing_rank:
                raise_from_forward(worker, step_n, v2=False)
            else:  # x: 2 of 2, in the aggregate vLLM drops at the KeyError
                replies[rank] = rank_reply(worker.after_forward(step_n))
        aggregated = harness._aggregator.aggregate(replies, output_rank=failing_rank)
        assert aggregated is not None
        with pytest.raises(KeyError, match="r"):
            harness.scheduler.update_from_output(step_n, aggregated)
        fault_abort(harness)
        for _ in range(8):  # N's outputs sent again, applied
            harness.step()
        assert "x" not in harness.scheduler.requests  # was: held, with its blocks, for good
        check_quiescent(harness)
    finally:
        harness.close()
