"""Pipeline parallelism with speculative decoding under vLLM 0.33's Model Runner V1.

V1 defers `wait_for_save` and `clear_connector_metadata` past the drafter whenever a
speculative config is set (`defer_kv_connector_finalize`), but only the last pipeline
stage runs the drafter and the deferred `finalize_kv_connector`: an earlier stage's
`execute_model` returns its intermediate tensors after the result calls, and its
`sample_tokens` returns the connector output alone. Its `wait_for_save` never comes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import check_quiescent
from test_vllm_pipeline import pipeline_harness
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm_harness import ConnectorWorker, shared_prefix_prompts


class EarlierStageV1Worker(ConnectorWorker):
    """A non-last stage's worker role as Model Runner V1 calls it with a speculative
    config: the result calls after the forward, then nothing until the next step."""

    def after_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        if not self._load_started:
            self.connector.start_load_kv(None)  # type: ignore[arg-type]
        results = self.connector.get_transfer_results(scheduler_output.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
            kv_connector_stats=self.connector.get_kv_connector_stats(),
            kv_connector_worker_meta=self.connector.build_connector_worker_meta(),
        )


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
