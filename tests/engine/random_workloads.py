"""Random workloads for the offload-off parity property (SPEC scenario 31), and their runner.

A `Workload` holds prompts built from a few shared (nested) prefixes, random tails and
follow-ups that extend an earlier answer, their sampling params, how they are split into
`generate` calls (repeated for 2-3 rounds), a GPU pool barely larger than the longest
request, and a tiny tier (CPU, disk, or a write-through / write-back cascade) with a store
mode and policies; optionally the worker finishes every copy within its step, or reports
some loads or stores as failed (failed loads also scribble over their destination
blocks). `workloads()` draws one; `run_workload` serves it through an engine with the tier
and the same engine with offload off, call by call, compares tokens and logits, checks the
offload scheduler's invariants and adds hit counters to a running total.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck
from hypothesis import strategies as st

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.engine.config import AttentionKind, LayerGroup, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.validation import num_peak_blocks
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig, StoreMode
from kvtier.offload.plan import TransferPlan, WorkerReport

MODELS = {"full": ModelConfig.tiny(), "hybrid": ModelConfig.tiny_hybrid()}
# Narrower windows, for `test_llm_random_tight_pools`: a window of 3 or 5 tokens spans
# blocks of 4 or 2 in every alignment; the sliding group first, or second.
MODELS["hybrid-w3"] = dataclasses.replace(MODELS["hybrid"], sliding_window=3)
MODELS["sliding-first-w5"] = dataclasses.replace(
    MODELS["hybrid"],
    layer_kinds=(AttentionKind.SLIDING, AttentionKind.FULL),
    sliding_window=5,
)
VOCAB = MODELS["full"].vocab_size
TIER_KINDS = ("cpu", "disk", "write_through", "write_back")
MAX_STEPS_PER_CALL = 5000  # a stuck engine fails the example instead of hanging pytest
MAX_PROMPT_TOKENS = 40  # longer follow-ups start afresh: a long request sizes the GPU pool

tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@dataclass(frozen=True)
class PromptSpec:
    """One prompt: a shared prefix (or an earlier prompt plus its answer), then a tail.

    `followup` picks, modulo their number, one of the requests finished by earlier
    `generate` calls; with none finished yet (or None) the prompt starts with `prefix`.
    """

    prefix: int | None
    followup: int | None
    tail: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Workload:
    """Everything one example draws; `batches` lists prompt indices per `generate` call."""

    model: str
    block_size: int
    prefixes: tuple[tuple[int, ...], ...]
    prompts: tuple[PromptSpec, ...]
    batches: tuple[tuple[int, ...], ...]
    gpu_slack_blocks: int
    rounds: int
    max_num_batched_tokens: int
    tier: str
    cpu_blocks: int
    disk_blocks: int
    store_mode: StoreMode
    eviction_policy: str
    admission_policy: str
    synchronous: bool
    fail_loads: bool
    fail_stores: bool


@st.composite
def prefix_trees(draw: st.DrawFn) -> tuple[tuple[int, ...], ...]:
    """Return 2-4 prefixes of 2-16 tokens; a later one may extend an earlier one."""
    prefixes: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(2, 4))):
        parent = draw(st.sampled_from([(), *prefixes]))
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=16))
        prefixes.append((*parent, *own)[:MAX_PROMPT_TOKENS])
    return tuple(prefixes)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    """Return greedy params (mostly) or seeded temperature sampling, 1-8 tokens."""
    max_tokens = draw(st.integers(1, 8))
    if draw(st.integers(0, 3)) == 0:
        seed = draw(st.integers(0, 2**16))
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Return a random workload (see the module docstring)."""
    prefixes = draw(prefix_trees())
    num_prompts = draw(st.integers(3, 10))
    prompts = []
    for _ in range(num_prompts):
        prefix = draw(st.integers(0, len(prefixes) - 1) | st.none())
        followup = draw(st.none() | st.integers(0, 15))
        tail = tuple(draw(tokens))
        prompts.append(PromptSpec(prefix, followup, tail, draw(sampling_params())))
    order = draw(st.permutations(range(num_prompts)))
    cuts = draw(st.lists(st.booleans(), min_size=num_prompts - 1, max_size=num_prompts - 1))
    batches: list[list[int]] = [[order[0]]]
    for index, cut in zip(order[1:], cuts, strict=True):
        if cut:
            batches.append([])
        batches[-1].append(index)
    tier = draw(st.sampled_from(TIER_KINDS))
    cpu_blocks = draw(st.integers(4, 32))
    disk_blocks = draw(st.integers(4, 48))
    if tier == "write_through":
        disk_blocks = max(disk_blocks, cpu_blocks)
    store_mode = draw(st.sampled_from(list(StoreMode)))
    return Workload(
        model=draw(st.sampled_from(("full", "hybrid"))),
        block_size=draw(st.sampled_from([4, 2])),
        prefixes=prefixes,
        prompts=tuple(prompts),
        batches=tuple(tuple(b) for b in batches),
        gpu_slack_blocks=draw(st.integers(0, 3)),
        rounds=draw(st.integers(2, 3)),
        max_num_batched_tokens=draw(st.sampled_from([64, 16, 8])),
        tier=tier,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        store_mode=store_mode,
        eviction_policy=draw(st.sampled_from(list(EVICTION_POLICIES))),
        admission_policy=draw(st.sampled_from(list(ADMISSION_POLICIES))),
        synchronous=draw(st.booleans()),
        fail_loads=draw(st.integers(0, 2)) == 0,
        fail_stores=draw(st.integers(0, 4)) == 0,
    )


# ---------------------------------------------------------------- resolving prompts


@dataclass(frozen=True)
class Submission:
    """One prompt as submitted: its parent request (a follow-up) or prefix, and its tail.

    `num_tokens` counts prompt and output tokens: outputs are exactly `max_tokens` long
    (`ignore_eos`), so every length is known before anything runs.
    """

    parent: int | None  # index into all submissions so far, in submission order
    head: tuple[int, ...]
    tail: tuple[int, ...]
    params: SamplingParams
    num_tokens: int


def plan_submissions(workload: Workload) -> list[list[Submission]]:
    """Resolve follow-ups against the requests finished by earlier calls."""
    calls: list[list[Submission]] = []
    done: list[Submission] = []
    for batch in workload.batches * workload.rounds:
        call = []
        for index in batch:
            spec = workload.prompts[index]
            parent = None if spec.followup is None or not done else spec.followup % len(done)
            if parent is not None and done[parent].num_tokens + len(spec.tail) > MAX_PROMPT_TOKENS:
                parent = None
            head = (
                () if spec.prefix is None or parent is not None else workload.prefixes[spec.prefix]
            )
            tail = spec.tail if head or spec.tail or parent is not None else (1,)
            prompt_len = len(head) + len(tail) + (0 if parent is None else done[parent].num_tokens)
            num_tokens = prompt_len + spec.params.max_tokens
            call.append(Submission(parent, head, tail, spec.params, num_tokens))
        calls.append(call)
        done.extend(call)
    return calls


# ---------------------------------------------------------------- engines


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


def with_watchdog(llm: LLM, max_steps: int) -> Callable[[], None]:
    """Make `llm.step` raise after `max_steps` steps; return a function that re-arms it.

    A request that can never be scheduled, or stores that never drain, would make
    `generate` or `drain` spin forever; an idle step sleeps 0.5 ms, so the cap is seconds.
    """
    step = llm.step
    left = [0]

    def guarded() -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise AssertionError(f"no progress within {max_steps} engine steps")
        return step()

    def arm() -> None:
        left[0] = max_steps

    llm.step = guarded  # type: ignore[method-assign]
    return arm


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


# The settings of the random-workload properties but their number of examples.
WORKLOAD_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,  # the same examples on every run
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


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
    arm = with_watchdog(llm, max_steps)
    finished: list[RequestOutput] = []
    for call in calls:
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
        llm.offload.scheduler.check_invariants()
        for want, got in zip(expected, outputs, strict=True):
            assert_same(want, got)
        finished.extend(expected)
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
