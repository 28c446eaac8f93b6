"""A rank's output that vLLM dropped after the connector calls of its step returned.

Under vLLM's fault tolerance a rank that raises after `build_connector_worker_meta`
(computing logits, sampling) has that step's output dropped whole; vLLM hands the other
ranks' outputs to the next step and aborts every request. The transfers the rank reported
done in it, and the loads it finished, must reach the scheduler again, exactly once
(`kvtier.adapters.vllm.redelivery`): else their pins stay held, vLLM waits for the loads
for good, and the engine never goes idle.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    kvtier_harness,
    num_resent,
    offload_worker,
)
from test_vllm_fault_tolerance import fault_abort, num_tier_blocks
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness

from kvtier.adapters.vllm.redelivery import Outbox, Output, Receipts
from kvtier.offload.plan import WorkerReport

PREFIX = list(range(5000, 5064))  # 4 full blocks


def output_dropped_on(harness: VllmHarness, dropped_rank: int) -> None:
    """Run one step whose output vLLM drops on `dropped_rank` (it raised after its
    connector calls), the other ranks' salvaged into the next step, then abort all."""
    step = harness.scheduler.schedule()
    for worker in harness.workers:
        worker.before_forward(step)
    salvaged = []
    for rank, worker in enumerate(harness.workers):
        output = worker.after_forward(step)  # the connector calls returned normally
        if rank != dropped_rank:
            salvaged.append(output)
    if len(harness.workers) > 1:
        harness._aggregator.ft_defer_kv_connector_outputs(salvaged)
    fault_abort(harness)


def held_back(harness: VllmHarness, kind: str) -> list[PollGate]:
    """Hold back every rank's reports of `kind` ("load" or "store")."""
    gates = [PollGate(offload_worker(harness, rank)) for rank in range(harness.cfg.num_ranks)]
    for gate in gates:
        gate.hold(kind)
    return gates


def release_before_the_next_step(harness: VllmHarness, gates: list[PollGate]) -> None:
    harness.wait_for_copies()
    for gate in gates:
        gate.release()  # reported at the next poll: that of the dropped output's step


@pytest.mark.parametrize(
    ("num_ranks", "dropped_rank", "scheduling"),
    [(1, 0, "sync"), (2, 0, "sync"), (2, 1, "sync"), (2, 1, "async_pipelined")],
)
def test_store_completions_of_a_dropped_output_are_sent_again(
    num_ranks: int, dropped_rank: int, scheduling: str
) -> None:
    harness = kvtier_harness(num_ranks=num_ranks, **SCHEDULING[scheduling])
    gates = held_back(harness, "store")
    harness.add_request("x", [*PREFIX, 1], max_tokens=50)
    for _ in range(4):
        harness.step()  # x's 4 blocks are stored on every rank, their completion held
    assert num_tier_blocks(harness) == 0
    release_before_the_next_step(harness, gates)
    output_dropped_on(harness, dropped_rank)
    drain(harness, 300)  # "engine still busy" while the completions are lost
    assert num_resent(harness) == 1  # the dropped output, once
    assert num_tier_blocks(harness) == 4
    check_quiescent(harness)
    if scheduling != "sync":
        return  # the harness ran steps past its batch queue: vLLM defers some frees
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("y", [*PREFIX, 2], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("y") == 64
    check_quiescent(harness)


@pytest.mark.parametrize(("num_ranks", "dropped_rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_load_finished_in_a_dropped_output_is_reported_to_vllm_again(
    num_ranks: int, dropped_rank: int
) -> None:
    """vLLM frees an aborted request waiting for its load only once every rank reported
    the load finished."""
    harness = kvtier_harness(num_ranks=num_ranks)
    harness.add_request("x", [*PREFIX, 1], max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    gates = held_back(harness, "load")
    harness.add_request("b", [*PREFIX, 7], max_tokens=4)
    harness.step()
    assert harness.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    release_before_the_next_step(harness, gates)
    output_dropped_on(harness, dropped_rank)
    drain(harness, 300)
    assert num_resent(harness) == 1
    check_quiescent(harness)
    harness.add_request("c", [*PREFIX, 8], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("c") + harness.local_hit_tokens("c") == 64
    check_quiescent(harness)


def test_an_output_dropped_twice_is_sent_until_it_arrives() -> None:
    harness = kvtier_harness(num_ranks=2)
    gates = held_back(harness, "store")
    harness.add_request("x", [*PREFIX, 1], max_tokens=50)
    for _ in range(4):
        harness.step()
    release_before_the_next_step(harness, gates)
    output_dropped_on(harness, 1)
    harness.step()  # the scheduler applies rank 0's salvaged output: rank 1's is missing
    output_dropped_on(harness, 1)  # rank 1 sends it again here: dropped again
    drain(harness, 300)
    assert num_resent(harness) == 2
    assert num_tier_blocks(harness) == 4
    check_quiescent(harness)


def test_a_delayed_output_is_not_taken_for_a_dropped_one() -> None:
    """Overlapped steps: plans are built before the previous step's output is applied."""
    harness = kvtier_harness(num_ranks=2, **SCHEDULING["async_pipelined"])
    for i in range(6):
        harness.add_request(f"r{i}", [*range(100 * i, 100 * i + 70)], max_tokens=8)
    drain(harness)
    assert num_resent(harness) == 0
    assert num_tier_blocks(harness) == 24
    check_quiescent(harness)


def report(*done: int) -> WorkerReport:
    return WorkerReport(done=dict.fromkeys(done, 1))


def test_outbox_sends_again_only_what_an_applied_step_lacks() -> None:
    outbox, receipts = Outbox(), Receipts()
    me = outbox.worker_id
    first = outbox.record(Output(1, report(10)))
    assert first == {me: (1, (1,))}
    second = outbox.record(Output(2, report(11)))  # dropped by vLLM
    third = outbox.record(Output(3, report(12)))
    receipts.note(first)
    # Applied through step 1 only: output 2 may be in flight still.
    assert outbox.acknowledge(receipts.acks(), receipts.processed_step) is None
    receipts.note(third)
    assert receipts.acks() == {me: (1, (3,))}
    resend = outbox.acknowledge(receipts.acks(), receipts.processed_step)
    assert resend is not None
    assert resend.report == report(11)
    assert outbox.num_resent == 1
    fourth = outbox.record(Output(4))  # carries output 2 again, and nothing new
    assert fourth == {me: (4, (2,))}
    receipts.note(fourth)
    assert receipts.acks() == {me: (3, ())}
    assert second == {me: (2, (2,))}
    assert outbox.acknowledge(receipts.acks(), receipts.processed_step) is None
    assert outbox.is_idle
    assert outbox.record(Output(5)) == {}  # nothing left to acknowledge: no entry


def test_an_empty_output_is_not_numbered_but_reports_the_step_while_any_is_unacked() -> None:
    outbox = Outbox()
    assert outbox.record(Output(1)) == {}
    outbox.record(Output(2, report(10)))
    assert outbox.record(Output(3)) == {outbox.worker_id: (3, ())}


def test_a_dropped_output_is_not_sent_again_before_the_scheduler_applied_a_later_step() -> None:
    outbox = Outbox()
    outbox.record(Output(5, report(10), frozenset({"a"})))
    assert outbox.acknowledge({}, processed_step=4) is None
    resend = outbox.acknowledge({}, processed_step=5)
    assert resend is not None
    assert resend.finished_recving == {"a"}
    outbox.record(Output(7))  # sent again with step 7's output
    assert outbox.acknowledge({}, processed_step=6) is None  # step 7 may be in flight


def test_an_output_applied_twice_is_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    receipts = Receipts()
    receipts.note({7: (3, (1, 2))})
    assert not caplog.records
    receipts.note({7: (4, (2, 3))})
    assert "worker outputs [2] of 7 applied twice" in caplog.text
    assert receipts.acks() == {7: (3, ())}


def test_every_output_dropped_before_an_applied_step_is_sent_again_at_once() -> None:
    """Outputs 1 and 2 both dropped: the next resend carries the contents of both."""
    outbox = Outbox()
    outbox.record(Output(1, report(10), frozenset({"a"}), frozenset({"a"})))  # a failed
    outbox.record(Output(2, report(11), frozenset({"b"}), invalid_blocks=frozenset({7})))
    outbox.record(Output(3, report(12)))
    resend = outbox.acknowledge({outbox.worker_id: (0, (3,))}, processed_step=3)
    assert resend is not None
    assert resend.report == WorkerReport.merge([report(10), report(11)])
    assert (resend.finished_recving, resend.failed_recving) == ({"a", "b"}, {"a"})
    assert resend.invalid_blocks == {7}  # b's suspect blocks: vLLM recomputes from there
    assert outbox.num_resent == 2
    assert outbox.record(Output(4)) == {outbox.worker_id: (4, (1, 2))}


def test_an_output_sent_again_is_carried_by_one_output_only() -> None:
    """Without a plan bound in between, the next output does not carry it a second
    time: the scheduler would count its contents twice."""
    outbox = Outbox()
    outbox.record(Output(1, report(10)))
    assert outbox.acknowledge({}, processed_step=1) is not None
    assert outbox.record(Output(2)) == {outbox.worker_id: (2, (1,))}
    assert outbox.record(Output(2)) == {outbox.worker_id: (2, ())}
