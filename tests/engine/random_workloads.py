"""Random workloads for the offload-off parity property (SPEC scenario 31).

A `Workload` holds prompts built from a few shared (nested) prefixes, random tails and
follow-ups that extend an earlier answer, their sampling params, how they are split into
`generate` calls (repeated for 2-3 rounds), a GPU pool barely larger than the longest
request, and a tiny tier (CPU, disk, or a write-through / write-back cascade) with a store
mode and policies; optionally the worker finishes every copy within its step, or reports
some loads or stores as failed (failed loads also scribble over their destination
blocks). `workloads()` draws one; `plan_submissions` resolves its follow-ups into each
call's prompts; `workload_runner.run_workload` serves it with offload on and off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck
from hypothesis import strategies as st

from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import StoreMode

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


# The settings of the random-workload properties but their number of examples.
WORKLOAD_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,  # the same examples on every run
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
