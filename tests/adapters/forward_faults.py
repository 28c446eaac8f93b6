"""`ForwardFaults`: steps whose forward raises under vLLM's fault tolerance, for
`random_ops` (its `Fault` operation).

Test helper only: import it after `pytest.importorskip("vllm")`. What
`test_vllm_fault_tolerance` does in one scenario each (`failed_forward`, `fault_abort`,
`failed_forward_on_one_rank`), here at any point of a random run: a step is scheduled,
its block copies run and every rank binds its plan (vLLM's model runner copies first);
the forward raises on one rank or on all, nothing is written, yet the raising ranks'
connectors still run their after-forward calls (Model Runner V1's `finally`; V2 calls
none) while the other ranks' outputs are salvaged into the next step's aggregate; then
the engine core aborts every request.

vLLM 0.33 keeps the hashes it gave the failed step's blocks when it scheduled them, and
would serve those unwritten blocks to a later request as local prefix hits (its own
bug): kvtier drops them from vLLM's prefix cache at the fault's aborts
(`GpuPoolView.discard_keys_of`), and the harness's read check fails a run where vLLM
serves one all the same.
"""

from __future__ import annotations

import contextlib
import copy

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness
from vllm_workers import WorkerSide


class ForwardError(RuntimeError):
    """The failed forward's exception (only it is swallowed: a connector's is not)."""


def raise_from_forward(worker: WorkerSide, scheduler_output: SchedulerOutput, v2: bool) -> None:
    """Raise from one rank's forward, calling its worker role as vLLM's model runner:
    V1 calls its after-forward part from a `finally`, V2 (`v2`) not at all."""
    with contextlib.suppress(ForwardError):
        try:
            raise ForwardError("forward failed")
        finally:  # V1's `_get_kv_connector_output`; V2's `post_forward` is never reached
            if not v2:
                worker.after_forward(scheduler_output)


def rank_reply(kv_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """A rank's `sample_tokens` reply carrying only `kv_output` (nothing: V1's empty
    reply), as the engine core receives it: an object of its own, deserialized from the
    rank's message. Not `ModelRunnerOutput.with_kv_conn_output_only`, which hands back
    vLLM's shared `EMPTY_MODEL_RUNNER_OUTPUT` for an empty output:
    `KVOutputAggregator.aggregate` writes the aggregate into its output rank's reply, and
    every later test's empty replies would carry it (conftest.py fails such a test)."""
    reply = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    reply.kv_connector_output = kv_output
    return reply


def drain_deferred_frees(harness: VllmHarness) -> None:
    """Free what vLLM fenced behind a failed step: that step is never processed, so the
    frees deferred behind it (overlapped steps) would wait forever (vLLM's matter);
    recover as if it had been."""
    scheduler = harness.scheduler
    if scheduler.defer_block_free:
        scheduler.processed_step_seq = scheduler.sched_step_seq
        scheduler._drain_deferred_frees()


class ForwardFaults:
    """Fail the forward of a harness's next step."""

    def __init__(self, harness: VllmHarness) -> None:
        self.harness = harness

    def fail_step(self, failing_rank: int | None, v2: bool = False) -> bool:
        """Run a step whose forward raises on `failing_rank` (on every rank: None) under
        Model Runner V1 or V2 (`v2`), then abort every request; do nothing and return
        False when vLLM has none.

        Steps launched before it (overlapped scheduling) complete first, as vLLM's batch
        queue returns them in order.
        """
        harness, scheduler = self.harness, self.harness.scheduler
        while harness._in_flight:
            harness._complete(*harness._in_flight.popleft())
        if not scheduler.has_requests():
            return False
        scheduler_output = scheduler.schedule()
        for cache in harness.caches:  # the model runner copies before the connector's calls
            cache.copy_blocks(scheduler_output.kv_cache_block_copies or ())
        for worker in harness.workers:
            worker.before_forward(scheduler_output)
        salvaged = []
        for rank, worker in enumerate(harness.workers):
            if failing_rank in (None, rank):
                raise_from_forward(worker, scheduler_output, v2)
            else:
                salvaged.append(worker.after_forward(scheduler_output))
        if salvaged:  # vLLM's multiproc executor (`ft_defer_kv_connector_outputs`)
            harness._aggregator.ft_defer_kv_connector_outputs(salvaged)
        try:  # kvtier tells a fault's aborts by the exception being handled
            raise ForwardError("One or more workers failed")
        except ForwardError:  # vLLM's `fault_tolerant_wrapper` → `on_fault`
            scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        drain_deferred_frees(harness)
        return True
