"""Pipeline parallelism with speculative decoding under vLLM 0.33's Model Runner V1.

V1 defers `wait_for_save` and `clear_connector_metadata` past the drafter whenever a
speculative config is set (`defer_kv_connector_finalize`), but only the last pipeline
stage runs the drafter and the deferred `finalize_kv_connector`: an earlier stage's
`execute_model` returns its intermediate tensors after the result calls, and its
`sample_tokens` returns the connector output alone. Its `wait_for_save` never comes.
The last stage's does, after the drafter's forward (which writes the draft layers' KV):
its stores wait for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent
from test_vllm_pipeline import pipeline_harness
from vllm.distributed import parallel_state
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm_harness import ConnectorWorker, shared_prefix_prompts

from kvtier.adapters.vllm import worker_side
from kvtier.adapters.vllm.connector import KVTierConnector
from kvtier.offload.plan import TransferPlan


class EarlierStageV1Worker(ConnectorWorker):
    """A non-last stage's worker role as Model Runner V1 calls it with a speculative
    config: the result calls after the forward, then nothing until the next step."""

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        if not self._load_started:
            self.connector.start_load_kv(None)  # type: ignore[arg-type]
        return self.results_output(scheduler_output)


def test_an_earlier_stage_without_wait_for_save_still_stores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Was: 'assert 0 == 48' for every prompt: stage 0's stores were never submitted, so
    # the next bind failed them (and took each step for a failed forward): nothing stored.
    harness = pipeline_harness(monkeypatch, first_stage=EarlierStageV1Worker)
    prompts = shared_prefix_prompts(6, prefix_len=48, suffix_len=8, num_prefixes=6)
    for request_id, prompt in prompts.items():
        harness.run_requests({request_id: prompt}, max_tokens=2)
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=2)  # both stages' caches are checked
    assert [harness.external_hit_tokens(r) for r in again] == [48] * len(again)
    check_quiescent(harness)


class LastStageV1Worker(ConnectorWorker):
    """The last stage's worker role as Model Runner V1 calls it with a speculative
    config: the result calls after the target forward, `wait_for_save` and
    `clear_connector_metadata` after the drafter's (`finalize_kv_connector`). Counts the
    plans with stores the offload worker got before that `wait_for_save`."""

    early_stores = 0
    stores = 0

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        connector = self.connector
        assert isinstance(connector, KVTierConnector)
        worker = connector.worker_side.worker
        submitted: list[TransferPlan] = []
        submit = worker.submit
        worker.submit = lambda plan: (submitted.append(plan), submit(plan))[1]  # type: ignore[method-assign]
        try:
            if not self._load_started:
                connector.start_load_kv(None)  # type: ignore[arg-type]
            results = connector.get_transfer_results(scheduler_output.finished_req_ids)
            meta = connector.build_connector_worker_meta()
            early = sum(any(job.is_store for job in plan.jobs) for plan in submitted)
            connector.wait_for_save()  # the drafter's forward came first
            connector.clear_connector_metadata()
        finally:
            del worker.submit
        self.early_stores += early
        self.stores += sum(any(job.is_store for job in plan.jobs) for plan in submitted)
        return KVConnectorOutput(
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=meta,
        )


def test_the_last_stage_stores_after_the_drafters_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Untested before: a last stage taken for an earlier one submitted its stores in
    # get_transfer_results, before the drafter wrote the draft layers' KV they copy.
    harness = pipeline_harness(
        monkeypatch, first_stage=EarlierStageV1Worker, last_stage=LastStageV1Worker
    )
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=8, num_prefixes=4)
    for request_id, prompt in prompts.items():
        harness.run_requests({request_id: prompt}, max_tokens=2)
    last = harness.workers[-1]
    assert isinstance(last, LastStageV1Worker)
    assert (last.early_stores, last.stores > 0) == (0, True)
    assert harness.scheduler.reset_prefix_cache()
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=2)
    assert [harness.external_hit_tokens(r) for r in again] == [48] * len(again)
    check_quiescent(harness)


@pytest.mark.parametrize(("first", "last"), [(True, False), (False, True), (True, True)])
def test_the_stage_is_vllms_pipeline_group_rank(
    monkeypatch: pytest.MonkeyPatch, first: bool, last: bool
) -> None:
    group = SimpleNamespace(is_first_rank=first, is_last_rank=last)
    monkeypatch.setattr(parallel_state, "_PP", group)
    assert worker_side.last_pipeline_stage() is last


def test_one_process_without_vllms_groups_is_the_last_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel_state, "_PP", None)  # "... group is not initialized"
    assert worker_side.last_pipeline_stage() is True
