"""Drive a real vLLM v1 `Scheduler` on CPU with a fake model runner.

Test helper only: import it after `pytest.importorskip("vllm")`. It needs the vLLM venv
(`make test-vllm`) and these variables, which `mk/vllm.mk` sets: VLLM_TARGET_DEVICE=cpu,
HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1.

What is real: vLLM's configs, `Scheduler`, KV cache manager, GPU block pool, request
hashing and the scheduler role of whatever KV connector is configured. What is fake: the
model runner. Each step it "computes" the scheduled tokens by writing a fingerprint of the
token prefix into a CPU tensor per layer (`FakeKVCache`), checks the fingerprints of every
position a newly scheduled request treats as already computed (local prefix hit or
external load) and, in a Mamba state group, the state every forward starts from, samples
a token per request past its prompt (and verifies drafts: fake_drafter.py), hands each
rank's worker side (`vllm_workers`) output back to the scheduler, merged across ranks the
way vLLM's executor merges it. A wrong block loaded, a block loaded from the wrong
slot or a load that never happened raises `KVMismatchError`.

Asynchronous scheduling (`HarnessConfig.async_scheduling`, vLLM 0.33's default): an
`AsyncScheduler`, lock-step by default. With `batch_queue_size=2` the harness overlaps
steps like vLLM's engine core: it schedules step N+1 (and runs its fake forward and
worker sides) before step N's output reaches the scheduler. The fake runner then samples
tokens vLLM holds as placeholders; fingerprints use them and check them once delivered.
The fake forward is synchronous: when step N+1 is launched, step N's KV is written, so
the checks never blame a correct engine; but a GPU race (a load landing before an
earlier, still queued forward writes the same block) cannot show up here. vLLM's
scheduler rules it out: for a KV-consuming connector under overlapping steps it defers
freeing a finished request's blocks until the steps that may write them completed
(`Scheduler.defer_block_free`); stores wait for the worker's compute-done mark.

Modules: `vllm_engine` (configs, scheduler, fake KV cache), `vllm_workers` (worker
sides), this one (the step loop and workloads); the names tests need are re-exported here.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from busy_steps import busy_steps
from fake_drafter import FakeDrafter
from fake_drafter import token_at as _token_at
from open_harnesses import OPEN, forget
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_engine import (
    SIMPLE_CPU_OFFLOAD,
    FakeKVCache,
    HarnessConfig,
    KVMismatchError,
    PrefixFingerprints,
    build_scheduler,
    write_tiny_llama,
)
from vllm_workers import (
    ConnectorWorker,
    FakeSimpleOffloadWorker,
    NoWorker,
    WorkerFactory,
    WorkerSide,
    connector_worker_factory,
    simple_offload_worker_factory,
)

__all__ = [
    "SIMPLE_CPU_OFFLOAD",
    "ConnectorWorker",
    "FakeKVCache",
    "FakeSimpleOffloadWorker",
    "HarnessConfig",
    "KVMismatchError",
    "NoWorker",
    "StepRecord",
    "VllmHarness",
    "WorkerFactory",
    "WorkerSide",
    "connector_worker_factory",
    "flatten_events",
    "shared_prefix_prompts",
    "simple_offload_worker_factory",
    "timed",
]


# --------------------------------------------------------------------------- harness


@dataclass
class StepRecord:
    """What one engine step did."""

    scheduler_output: SchedulerOutput
    outputs: dict[int, EngineCoreOutputs]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: set[str]


# The harness's engine loop is pure Python: unlike a GPU engine it never waits on a device
# with the GIL released, so the worker's copy threads would get the GIL only every switch
# interval (5 ms by default), per handoff (measured: 512 KiB copies taking 20-60 ms, and
# ten times the steps of vLLM's synchronous stand-in worker). Set for the whole process
# that imports this module: the adapter tests (`make test-vllm`) and the vLLM benchmark.
SWITCH_INTERVAL_S = 0.0002
sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))


class VllmHarness:
    """A real vLLM scheduler, a fake model runner and one worker side per rank."""

    def __init__(
        self,
        cfg: HarnessConfig,
        worker_factory: WorkerFactory | None = None,
        check_kv: bool = True,
    ) -> None:
        self.cfg = cfg
        # The fake cache's tensors are tiny; extra intra-op threads only contend for
        # the (shared) CPUs and made steps several times slower.
        torch.set_num_threads(1)
        self._model_dir = tempfile.TemporaryDirectory(prefix="kvtier-vllm-")
        write_tiny_llama(self._model_dir.name, cfg)
        init_none_hash(sha256)
        self.scheduler, self.vllm_config, self.kv_cache_config = build_scheduler(
            cfg, self._model_dir.name
        )
        self._block_hasher = get_request_block_hasher(cfg.hash_block_size, sha256)  # hash blocks
        self.check_kv = check_kv
        self.drafter = FakeDrafter.for_config(cfg)
        self.caches = [FakeKVCache(self.kv_cache_config) for _ in range(cfg.num_ranks)]
        factory = worker_factory or (lambda harness, cache: NoWorker())
        self.workers: list[WorkerSide] = [factory(self, cache) for cache in self.caches]
        self._aggregator = KVOutputAggregator(expected_finished_count=cfg.num_ranks)
        self._fingerprints = PrefixFingerprints()
        self.requests: dict[str, Request] = {}
        # request id -> (local hit tokens, external hit tokens) at first admission
        self.admissions: dict[str, tuple[int, int]] = {}
        self._unadmitted: set[str] = set()
        self.finished: set[str] = set()
        self.event_batches: list[KVEventBatch] = []
        self.num_steps = 0
        # Launched steps awaiting `update_from_output`, oldest first (vLLM's batch queue).
        self._in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        publisher = self.scheduler.kv_event_publisher
        publish = publisher.publish

        def record(batch: KVEventBatch) -> None:
            self.event_batches.append(batch)
            publish(batch)

        publisher.publish = record  # type: ignore[method-assign]
        OPEN.append(self)  # closed at the test's teardown at the latest (conftest.py)

    def close(self) -> None:
        """Shut down the workers' connectors (idempotent; a `MultiConnector` worker side's
        children's too) and remove the model directory."""
        forget(self)
        for worker in self.workers:
            for part in getattr(worker, "children", [worker]):
                connector = getattr(part, "connector", None)
                if connector is not None:
                    connector.shutdown()
        self._model_dir.cleanup()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 4,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        **sampling: Any,
    ) -> Request:
        """Create a hashed request and add it to the scheduler's waiting queue.

        `priority` is vLLM's: under the "priority" policy a lower value runs first.
        `lora_request` runs it with that adapter (needs `HarnessConfig.max_loras`); its
        name and path are hashed into every block, as vLLM's engine does.
        """
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
        )
        self.requests[request_id] = request
        self._unadmitted.add(request_id)
        self.scheduler.add_request(request)
        return request

    def external_hit_tokens(self, request_id: str) -> int:
        """Return the tokens this request's first admission took from the connector."""
        return self.admissions[request_id][1]

    def local_hit_tokens(self, request_id: str) -> int:
        """Return the tokens this request's first admission took from the GPU cache."""
        return self.admissions[request_id][0]

    def _record_admissions(self) -> None:
        # The scheduler fills `prefill_stats` at a request's first admission and
        # drops it with the request's first output, so read it right after schedule().
        for req_id in list(self._unadmitted):
            stats = self.requests[req_id].prefill_stats
            if stats is not None and stats.num_prompt_tokens > 0:
                self.admissions[req_id] = (
                    stats.num_local_cached_tokens,
                    stats.num_external_cached_tokens,
                )
                self._unadmitted.discard(req_id)

    # ------------------------------------------------------------------ stepping

    def step(self) -> StepRecord:
        """Run one engine step: schedule, fake forward, worker sides, update.

        With `batch_queue_size` > 1 this is one turn of vLLM's `step_with_batch_queue`
        that processes an output: launch steps (schedule, forward, worker sides) until the
        queue is full or nothing is left to schedule, then process the oldest step's
        output. The record is that step's. An idle engine still runs an empty step.
        """
        if not self._in_flight:
            self._in_flight.append(self._launch())
        while len(self._in_flight) < self.cfg.batch_queue_size and self.scheduler.has_requests():
            self._in_flight.append(self._launch())
        return self._complete(*self._in_flight.popleft())

    def is_busy(self) -> bool:
        """Return True while vLLM has requests or a launched step awaits its output."""
        return bool(self._in_flight) or self.scheduler.has_requests()

    def _launch(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        scheduler_output = self.scheduler.schedule()
        self._record_admissions()
        for cache in self.caches:  # vLLM's model runner: before the connector's calls
            cache.copy_blocks(scheduler_output.kv_cache_block_copies or ())
        for worker in self.workers:
            worker.before_forward(scheduler_output)
        sampled = self._forward(scheduler_output)
        runner_outputs = []
        for worker in self.workers:
            runner_outputs.append(
                ModelRunnerOutput(
                    req_ids=list(sampled),
                    req_id_to_index={req_id: i for i, req_id in enumerate(sampled)},
                    sampled_token_ids=list(sampled.values()),
                    kv_connector_output=worker.after_forward(scheduler_output),
                )
            )
        runner_output = (
            runner_outputs[0]
            if len(runner_outputs) == 1
            else self._aggregator.aggregate(runner_outputs)
        )
        assert runner_output is not None
        return scheduler_output, runner_output

    def _complete(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> StepRecord:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.drafter:  # vLLM's post_step
            self.drafter.after_step(self.scheduler, scheduler_output)
        finished = {
            out.request_id
            for eco in outputs.values()
            for out in eco.outputs
            if out.finish_reason is not None
        }
        for req_id in finished:
            self._fingerprints.forget(req_id)
        self.finished |= finished
        self.num_steps += 1
        return StepRecord(
            scheduler_output, outputs, dict(scheduler_output.num_scheduled_tokens), finished
        )

    def run(self, max_steps: int = 1000) -> int:
        """Step until the engine is idle (`is_busy`); return the steps taken.

        A step that scheduled nothing only waits for the workers' copies: the workers'
        copies are then waited for (`wait_for_copies`), so `max_steps` bounds the steps
        of a stalled engine, not the time a CPU-starved copy thread takes.
        """
        return sum(1 for _ in busy_steps(self, max_steps))

    def drain_step(self) -> StepRecord:
        """One step of a loop that steps until idle under a step cap: `step`, then,
        when it scheduled nothing, `wait_for_copies` (as `run`)."""
        record = self.step()
        if not record.num_scheduled_tokens:
            self.wait_for_copies()
        return record

    def wait_for_copies(self) -> None:
        """Block until every kvtier worker side's submitted copies finished.

        An idle step of this pure-Python engine loop takes well under a millisecond, so
        a step cap of a few thousand was about a second: a copy thread that a loaded
        machine did not run for that long failed a drain as "engine still busy" (a
        flake, no hang). Waiting here is a slow step, which vLLM allows any step to be.
        The class's `flush` waits for the copies started, past a wrapper's (a
        `FaultyWorker` starts its delayed jobs in its own, on the polls it chose).
        """
        for worker in self.workers:
            for part in getattr(worker, "children", [worker]):
                side = getattr(getattr(part, "connector", None), "worker_side", None)
                if side is not None:
                    type(side.worker).flush(side.worker)

    def run_requests(
        self, prompts: Mapping[str, Sequence[int]], max_tokens: int = 4, max_steps: int = 1000
    ) -> int:
        """Add `prompts`, run until idle, and return the steps taken."""
        for request_id, prompt in prompts.items():
            self.add_request(request_id, prompt, max_tokens)
        return self.run(max_steps)

    def _forward(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        fresh = {data.req_id for data in scheduler_output.scheduled_new_reqs}
        fresh |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
        sampled: dict[str, list[int]] = {}
        all_drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            drafts = all_drafts.get(req_id, [])  # an EAGLE config's (`HarnessConfig.eagle`)
            end = request.num_computed_tokens - len(drafts)  # advanced by schedule()
            end -= self.drafter.shift(req_id, req_id in fresh) if self.drafter else 0  # async
            start = end - num_new + len(drafts)
            # A request still inside its prompt samples nothing this step; otherwise the
            # token at `end` (past a placeholder not yet delivered under async scheduling).
            sampled[req_id] = [] if request.is_prefill_chunk else [_token_at(req_id, end)]
            if self.drafter and drafts:  # else every draft is rejected, its KV unwritten
                drafts, sampled[req_id] = self.drafter.verify(req_id, end, drafts, scheduler_output)
            if self.check_kv:
                tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)  # per group
                prints = self._fingerprints.upto(request, end, partial(_token_at, req_id))
                if self.drafter and drafts:
                    prints = prints + self.drafter.draft_prints(prints, drafts)
                for cache in self.caches:
                    if req_id in fresh:
                        cache.check(req_id, tables, prints, start)
                    else:  # a Mamba group's forward reads the state it left last step
                        cache.check_states(req_id, tables, prints, start)
                    cache.write(tables, start, prints)
        return sampled


# --------------------------------------------------------------------------- workloads


def shared_prefix_prompts(
    num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int = 1, seed: int = 0
) -> dict[str, list[int]]:
    """Return prompts where request i shares prefix `i % num_prefixes` with others."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [
        torch.randint(1000, 30000, (prefix_len,), generator=gen).tolist()
        for _ in range(num_prefixes)
    ]
    return {
        f"req-{i}": prefixes[i % num_prefixes]
        + torch.randint(1000, 30000, (suffix_len,), generator=gen).tolist()
        for i in range(num_requests)
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Return `fn()` and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def flatten_events(batches: Iterable[KVEventBatch]) -> list[Any]:
    """Return every event of `batches`, in order."""
    return [event for batch in batches for event in batch.events]
