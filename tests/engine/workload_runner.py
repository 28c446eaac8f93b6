"""The runner of the random workloads (`random_workloads`): `run_workload` serves one
through an engine with the tier and the same engine with offload off, call by call,
compares tokens and logits, checks the offload scheduler's invariants and its copy of
every scheduled request's block tables (`check_tables_each_plan`) and adds hit counters
to a running total. `Faults` wraps the offload worker to finish copies within their step
or fail some of them.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from random_workloads import MAX_STEPS_PER_CALL, MODELS, Submission, Workload, plan_submissions
from step_watchdog import with_watchdog

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.config import LayerGroup
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.validation import num_peak_blocks
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import TransferPlan, WorkerReport
from kvtier.offload.protocols import StepInput


class Faults:
    """Wrap an offload worker: optionally finish every copy in its step, fail some jobs.

    With `fail_loads` (`fail_stores`), every load (store or demotion) with an even event
    id is reported failed though its copy happened. A failed load first scribbles over
    its GPU destination blocks, so a scheduler that used them anyway yields wrong tokens.
    """

    def __init__(self, worker: Any, llm: LLM, workload: Workload) -> None:
        self.worker = worker
        self.kv_tensors = llm.runner.kv_tensors
        self.workload = workload
        self.load_dst: dict[int, tuple[int, ...]] = {}
        self.num_failed = Counter[str]()

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            if job.is_load:
                self.load_dst[job.event_id] = job.dst_block_ids
        self.worker.submit(plan)
        if self.workload.synchronous:
            self.worker.flush()

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        done = dict(report.done)
        failed = dict(report.failed)
        for event_id in list(done):
            is_load = event_id in self.load_dst
            wanted = self.workload.fail_loads if is_load else self.workload.fail_stores
            if wanted and event_id % 2 == 0:
                failed[event_id] = done.pop(event_id)
                self.num_failed["load" if is_load else "store"] += 1
                for block_id in self.load_dst.get(event_id, ()):
                    for layer in self.kv_tensors:
                        layer[:, block_id] = 1e3
        for event_id in (*done, *failed):
            self.load_dst.pop(event_id, None)
        return WorkerReport(done=done, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def offload_config(workload: Workload, bytes_per_block: int, disk_path: str) -> OffloadConfig:
    """Return the drawn tier, sized in blocks of the drawn layout."""
    cpu_bytes = workload.cpu_blocks * bytes_per_block
    disk_bytes = workload.disk_blocks * bytes_per_block
    sizes: dict[str, Any] = {
        "cpu": {"cpu_bytes": cpu_bytes},
        "disk": {"disk_bytes": disk_bytes},
        "write_through": {"cpu_bytes": cpu_bytes, "disk_bytes": disk_bytes},
        "write_back": {
            "cpu_bytes": cpu_bytes,
            "disk_bytes": disk_bytes,
            "cascade": CascadeMode.WRITE_BACK,
        },
    }[workload.tier]
    return OffloadConfig(
        disk_path=disk_path if "disk_bytes" in sizes else None,  # else: warned of as ignored
        disk_io_mode=DiskIOMode.PAGE_CACHE,  # tmpfs may refuse O_DIRECT
        store_mode=workload.store_mode,
        eviction_policy=workload.eviction_policy,
        admission_policy=workload.admission_policy,
        max_batched_tokens=workload.max_num_batched_tokens,  # as the vLLM adapter sets it
        **sizes,
    )


def assert_same(reference: RequestOutput, other: RequestOutput) -> None:
    """Check the tokens are identical and the logits equal within float32 noise, and
    that `other`'s hits fit its prompt (the last token is always computed)."""
    num_hits = other.num_local_hit_tokens + other.num_external_hit_tokens
    assert 0 <= other.num_external_hit_tokens <= num_hits < len(other.prompt_token_ids), other
    assert other.output_token_ids == reference.output_token_ids, (
        f"{other.request_id}: {other.output_token_ids} != {reference.output_token_ids} "
        f"({other.num_external_hit_tokens} tokens from the tier)"
    )
    assert reference.logits is not None
    assert other.logits is not None
    assert torch.allclose(reference.logits, other.logits, atol=1e-4, rtol=0), other.request_id


def on_one_thread(check: Callable[[], None]) -> None:
    """Run `check` with one torch intra-op thread: the model is tiny, one thread is as
    fast, and an OpenMP team spinning on a busy machine can be 10x slower."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check()
    finally:
        torch.set_num_threads(num_threads)


def kv_group_spec(group: LayerGroup, block_size: int) -> KVGroupSpec:
    """Return the KV group of a model's layer group (its block sizes and bytes aside)."""
    kind = (
        GroupKind.SLIDING_WINDOW if group.sliding_window is not None else GroupKind.FULL_ATTENTION
    )
    return KVGroupSpec(kind, block_size, 0, group.sliding_window)


def run_workload(
    workload: Workload,
    totals: Counter[str],
    max_steps: int = MAX_STEPS_PER_CALL,
    tight: bool = False,
) -> None:
    """Serve `workload` with offload off and on, call by call; compare every output.

    The GPU pool holds the longest request's blocks of every group plus
    `gpu_slack_blocks`; `tight`: only its peak at one position (`num_peak_blocks`, which
    a hybrid model's sliding group keeps below the whole sequence) plus the slack.
    """
    model = MODELS[workload.model]
    groups = len(model.layer_groups())
    calls = plan_submissions(workload)
    longest = max(sub.num_tokens for call in calls for sub in call) - 1  # last: not computed
    blocks_per_group = -(-longest // workload.block_size)
    needed = groups * blocks_per_group
    if tight:
        specs = (kv_group_spec(group, workload.block_size) for group in model.layer_groups())
        needed = num_peak_blocks(KVLayout(tuple(specs)), longest)
    engine = EngineConfig(
        block_size=workload.block_size,
        num_gpu_blocks=needed + 1 + workload.gpu_slack_blocks,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        keep_logits=True,
    )
    bytes_per_block = model.kv_bytes_per_token() * workload.block_size
    with tempfile.TemporaryDirectory(prefix="kvtier-random-") as disk_path:
        config = offload_config(workload, bytes_per_block, disk_path)
        # No `with` around the engine under test: its exit would drain, and a stuck drain
        # is what the watchdog reports.
        with LLM(model, engine=engine) as reference:
            llm = LLM(model, config, engine)
            try:
                serve(workload, calls, reference, llm, totals, max_steps)
            finally:
                assert llm.offload is not None
                llm.offload.shutdown()


def generate_both(
    call: list[Submission],
    finished: list[RequestOutput],
    reference: LLM,
    llm: LLM,
    arm: Callable[[], None],
) -> list[RequestOutput]:
    """Run one `generate` call on `reference`, then (armed) on `llm`; assert the same
    outputs, append the reference's to `finished`, return `llm`'s.

    A submission's prompt is its head (or its parent's whole conversation so far, from
    `finished`) followed by its tail.
    """
    prompts = []
    for sub in call:
        if sub.parent is None:
            head = list(sub.head)
        else:
            parent = finished[sub.parent]
            head = [*parent.prompt_token_ids, *parent.output_token_ids]
        prompts.append(head + list(sub.tail))
    params = [sub.params for sub in call]
    expected = reference.generate(prompts, params)
    arm()
    outputs = llm.generate(prompts, params)
    for want, got in zip(expected, outputs, strict=True):
        assert_same(want, got)
    finished.extend(expected)
    return outputs


def serve(
    workload: Workload,
    calls: list[list[Submission]],
    reference: LLM,
    llm: LLM,
    totals: Counter[str],
    max_steps: int,
) -> None:
    """Submit `calls` to both engines; compare outputs; add counters to `totals`."""
    assert llm.offload is not None
    faults = Faults(llm.offload.worker, llm, workload)
    llm.offload.worker = faults
    check_tables_each_plan(llm, totals)
    arm = with_watchdog(llm, max_steps)
    finished: list[RequestOutput] = []
    for call in calls:
        outputs = generate_both(call, finished, reference, llm, arm)
        llm.offload.scheduler.check_invariants()
        totals["external_hit_tokens"] += sum(o.num_external_hit_tokens for o in outputs)
    arm()
    llm.drain()
    llm.offload.scheduler.check_invariants()
    hits = llm.offload.totals.hit_tokens
    totals["examples"] += 1
    totals["examples_with_hits"] += sum(hits.values()) > 0
    totals[f"examples_with_hits_{workload.tier}"] += sum(hits.values()) > 0
    totals["cpu_hit_tokens"] += hits.get("CPU", 0)
    totals["disk_hit_tokens"] += hits.get("DISK", 0)
    totals["local_hit_tokens"] += llm.stats.num_local_hit_tokens
    totals["prompt_tokens"] += llm.stats.num_prompt_tokens
    totals["preemptions"] += llm.stats.num_preemptions
    totals["failed_loads"] += faults.num_failed["load"]
    totals["failed_stores"] += faults.num_failed["store"]
    totals["demoted_blocks"] += llm.offload.totals.num_demoted_blocks


def check_tables_each_plan(llm: LLM, totals: Counter[str]) -> None:
    """After every plan, assert the offload side's table of each scheduled request is the
    engine's: the same blocks, but where the engine nulled a block its window (or state
    group) dropped, which the offload side is never told (as under vLLM). Preemptions,
    idle releases and failed loads send the tables whole (`TableUpdate.REPLACE`)."""
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    build_plan = scheduler.build_plan
    groups = scheduler.layout.groups

    def checked(step: StepInput) -> TransferPlan:
        plan = build_plan(step)
        for item in step.scheduled:
            state = scheduler.selector.tracked.get(item.request.request_id)
            if state is None:  # lazy mode, or known at a reset
                continue
            tables = item.request.block_tables  # type: ignore[attr-defined]
            for group, mine, theirs in zip(groups, state.block_ids, tables, strict=True):
                where = f"{item.request.request_id}: offload side {mine}, engine {theirs}"
                assert len(mine) == len(theirs), where
                for ours, real in zip(mine, theirs, strict=True):
                    if ours != real:
                        assert group.kind is not GroupKind.FULL_ATTENTION, where
                        assert real == NULL_BLOCK_ID, where
            totals["tables_compared"] += 1
        return plan

    scheduler.build_plan = checked  # type: ignore[method-assign]
