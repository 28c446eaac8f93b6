"""`KVTierConnector` under vLLM's priority scheduling policy (`policy="priority"`).

vLLM orders both waiting queues by (priority, arrival), a lower priority value first, and
keeps no front of the queue for a skipped or preempted request; a running request short
of blocks preempts the lowest-priority running one. The failed-load work-arounds of
`SchedulerSide.lookup` were written against FCFS (a skipped request goes back to the
front): these tests run them where the failed request is not at the front, plus random
operations with random priorities (`test_vllm_random_ops`).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm")

import test_vllm_random_ops
from faulty_worker import FaultyWorker
from hypothesis import strategies as st
from kvtier_vllm import (
    check_quiescent,
    drain,
    kvtier_harness,
    offload_worker,
    scheduler_side,
    zero_blocks,
)
from random_ops import MAX_PREFIX_BLOCKS, NUM_FAMILIES, Add, Engine
from test_vllm_connector_faults import run_a_failed_load_on_the_tight_hybrid_pool
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm_engine import KVGroupDef
from vllm_harness import VllmHarness

LOW, HIGH = 1, 0  # vLLM runs a lower priority value first


def tokens(seed: int, count: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(1000, 30000) for _ in range(count)]


def record_lookups(harness: VllmHarness) -> dict[str, list[tuple[int, int | None]]]:
    """Record each request's (step, tokens offered) per connector lookup."""
    side = scheduler_side(harness)
    lookup = side.lookup
    answers: dict[str, list[tuple[int, int | None]]] = collections.defaultdict(list)

    def recorded(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = lookup(request, num_computed_tokens)
        answers[request.request_id].append((harness.num_steps, result[0]))
        return result

    side.lookup = recorded  # type: ignore[method-assign]
    return answers


def test_the_harness_hands_the_priority_policy_to_vllm() -> None:
    harness = kvtier_harness(scheduling_policy="priority", max_num_seqs=1)
    assert harness.scheduler.policy is SchedulingPolicy.PRIORITY
    harness.add_request("early-low", tokens(1, 20), max_tokens=2, priority=LOW)
    harness.add_request("late-high", tokens(2, 20), max_tokens=2, priority=HIGH)
    assert list(harness.step().num_scheduled_tokens) == ["late-high"]
    drain(harness)
    fcfs = kvtier_harness(max_num_seqs=1)
    assert fcfs.scheduler.policy is SchedulingPolicy.FCFS
    fcfs.add_request("early-low", tokens(1, 20), max_tokens=2, priority=LOW)
    fcfs.add_request("late-high", tokens(2, 20), max_tokens=2, priority=HIGH)
    assert list(fcfs.step().num_scheduled_tokens) == ["early-low"]
    drain(fcfs)


@pytest.mark.parametrize(
    "priorities",
    [(LOW, HIGH), (HIGH, LOW), (HIGH, HIGH)],
    ids=["first_low", "first_high", "same"],
)
def test_a_failed_load_on_a_tight_hybrid_pool_does_not_stall_under_priority(
    priorities: tuple[int, int],
) -> None:
    # test_vllm_connector_faults' tight-pool test under the priority policy: two
    # 69-token prompts come back as one failing load on 16 GPU blocks, the first-arrived
    # request (whose recompute does not fit beside the other's blocks) last or first.
    run_a_failed_load_on_the_tight_hybrid_pool("priority", priorities)


# A failed request that waits: its 165-token prompt (11 blocks) fails to load, three
# fillers (96-token prompts growing to 144 tokens) take the pool meanwhile, so its
# recompute fits only once they finish (~40 steps). Tier hits of 64 tokens (4 blocks).
FAILED = tokens(1, 165)
HITS = {"hit-high": tokens(2, 69), "hit-low": tokens(3, 69)}
FILLERS = {f"filler-{i}": tokens(10 + i, 96) for i in range(3)}


def failed_request_waiting(policy: str, failed_priority: int) -> VllmHarness:
    """Return a harness whose request "failed" waits to recompute and whose tier holds
    `HITS`; the fillers run. The next load fails."""
    harness = kvtier_harness(
        num_cpu_blocks=512,  # keeps the hits while ~80 requests pass (5 blocks each)
        num_gpu_blocks=32,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        scheduling_policy=policy,
    )
    harness.run_requests({"store-failed": FAILED, **HITS}, max_tokens=1)
    assert harness.scheduler.reset_prefix_cache()
    worker = FaultyWorker(offload_worker(harness), zero_blocks(harness))
    worker.fail["load"], worker.hold["load"] = 1, 6  # reported once the fillers run
    harness.add_request("failed", FAILED, max_tokens=4, priority=failed_priority)
    harness.step()
    worker.hold["load"] = 0
    for request_id, prompt in FILLERS.items():
        harness.add_request(request_id, prompt, max_tokens=48, priority=HIGH)
    side = scheduler_side(harness)
    for _ in range(20):
        if side.offload.loads.recompute_next:
            return harness
        harness.step()
    raise AssertionError("the load never failed")


def first_steps(harness: VllmHarness, stream: Callable[[int], None]) -> dict[str, int]:
    """Drain, calling `stream(step)` before each step; return each request's first step."""
    first: dict[str, int] = {}
    start = harness.num_steps
    while harness.is_busy():
        assert harness.num_steps - start < 500, "engine still busy"
        stream(harness.num_steps - start)
        for request_id in harness.step().num_scheduled_tokens:
            first.setdefault(request_id, harness.num_steps - 1 - start)
    return first


def test_a_low_priority_failed_load_does_not_hold_back_higher_priority_tier_hits() -> None:
    # Regression: while a failed request waits to be allocated, vLLM 0.33 still reserves
    # its whole recompute, so no async load is admitted beside it; kvtier answered every
    # tier hit "ask again later". Under the priority policy a higher-priority request so
    # skipped waited for the low-priority failed request, which waits as long as
    # higher-priority requests keep the pool: with one arriving every other step for 150
    # steps the hit ran at step 236 (vLLM alone, offered the hit, stops its scan there
    # until the fillers finish: step 43). Under the priority policy a hit looked up
    # ahead of every waiting failed request now answers 0 and recomputes at once; one
    # behind it still waits, and keeps its hit.
    harness = failed_request_waiting("priority", failed_priority=LOW)
    answers = record_lookups(harness)
    harness.add_request("hit-high", HITS["hit-high"], max_tokens=4, priority=HIGH)
    harness.add_request("hit-low", HITS["hit-low"], max_tokens=4, priority=LOW + 1)

    def stream(step: int) -> None:
        if step < 150 and step % 2 == 0:
            harness.add_request(f"stream-{step}", tokens(1000 + step, 69), 16, priority=HIGH)

    first = first_steps(harness, stream)
    assert first["hit-high"] <= 2, "held back behind the low-priority failed request"
    assert harness.external_hit_tokens("hit-high") == 0  # recomputed, not loaded
    # None only in the pass where the failed request was requeued (looked up first).
    assert [n for _, n in answers["hit-high"]] == [None, 0]
    # Behind the failed request: asked again later, then served from the tier.
    assert first["hit-low"] > first["failed"] > 150
    assert None in [n for _, n in answers["hit-low"]]
    assert harness.external_hit_tokens("hit-low") == 64
    check_quiescent(harness)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_behind_a_failed_load_wait_for_it_and_keep_their_hits(policy: str) -> None:
    # Under FCFS the requeued failed request heads the waiting queue; under the priority
    # policy (same priority, it arrived first) it goes first too. The hits behind it
    # wait until it is allocated (~40 steps), then load: no token recomputed.
    harness = failed_request_waiting(policy, failed_priority=HIGH)
    answers = record_lookups(harness)
    for request_id, prompt in HITS.items():
        harness.add_request(request_id, prompt, max_tokens=4, priority=HIGH)
    first = first_steps(harness, lambda step: None)
    for request_id in HITS:
        assert first[request_id] > first["failed"] > 30
        assert harness.external_hit_tokens(request_id) == 64
        assert all(n in (None, 64) for _, n in answers[request_id])
    check_quiescent(harness)


# Random operations (test_vllm_random_ops) with random priorities, on the one-group
# pool and on the tight hybrid pool where a failed load once stalled vLLM under FCFS.
PRIORITY_ADDS = st.builds(
    Add,
    st.integers(1, 3),
    st.integers(0, NUM_FAMILIES - 1),
    st.integers(0, MAX_PREFIX_BLOCKS),
    st.sampled_from([0, 5, 16, 21]),
    st.integers(0, 2),
    st.integers(1, 32),
    st.integers(0, 2),
)
PRIORITY_OPS = st.sampled_from(
    [PRIORITY_ADDS if k is test_vllm_random_ops.ADDS else k for k in test_vllm_random_ops.OP_KINDS]
).flatmap(lambda kind: kind)
FULL = KVGroupDef(16)
ENGINES = [
    Engine("priority_eager", scheduling_policy="priority"),
    Engine(
        "priority_window_tight_pool",
        kv_groups=(FULL, KVGroupDef(16, 32)),
        num_gpu_blocks=16,
        scheduling_policy="priority",
    ),
]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.name)
def test_random_operations_with_priorities_serve_correct_kv(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `explore` draws from its module's OPS when called; swapping that (rather than
    # passing a strategy) keeps the FCFS tests' derandomized examples as they are: the
    # seed hashes the source of the function it decorates.
    monkeypatch.setattr(test_vllm_random_ops, "OPS", PRIORITY_OPS)
    totals = test_vllm_random_ops.explore(engine, max_examples=25)
    assert totals["random_hit_tokens"] > 0, "no request took tokens from the tier"
    assert totals["replay_hit_tokens"] > 0
    assert totals["failed_load"] > 0
    assert totals["preemptions"] > 0
    assert totals["aborts"] > 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_load_failed_at_a_kept_prefix_costs_no_other_request_its_hit(policy: str) -> None:
    # The low-priority request's load fails at one named block past its first: vLLM
    # keeps its prefix and its blocks (kv_holding_waiting, scanned before any lookup),
    # so while kvtier holds it as failed no lookup meets it, and the hits load.
    # (Coverage of SchedulerSide.lookup's note on loads failed by block.)
    harness = kvtier_harness(
        num_cpu_blocks=512,
        num_gpu_blocks=32,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        scheduling_policy=policy,
    )
    harness.run_requests({"store-failed": FAILED, **HITS}, max_tokens=1)
    assert harness.scheduler.reset_prefix_cache()
    worker = FaultyWorker(offload_worker(harness), zero_blocks(harness))
    worker.fail_part, worker.hold["load"] = 1, 6
    loads = scheduler_side(harness).offload.loads
    offer = loads.offer
    held: list[tuple[str, int, int | None]] = []  # offers made while a failure is held

    def recorded(request_id: str, num_tokens: int) -> int | None:
        answer = offer(request_id, num_tokens)
        if loads.recompute_next:
            held.append((request_id, num_tokens, answer))
        return answer

    loads.offer = recorded  # type: ignore[method-assign]
    harness.add_request("failed", FAILED, max_tokens=4, priority=LOW)
    harness.step()
    worker.hold["load"] = 0
    for request_id, prompt in {**FILLERS, **HITS}.items():
        harness.add_request(request_id, prompt, max_tokens=48, priority=HIGH)
    kept = False
    while harness.is_busy():
        assert harness.num_steps < 500, "engine still busy"
        if "failed" in loads.recompute_next:
            kept = harness.scheduler.requests["failed"].num_computed_tokens > 0
        harness.step()
    assert kept  # the load failed, and vLLM kept a prefix
    assert not held  # no lookup while it waited: no hit turned into 0 or None
    for request_id in HITS:
        assert harness.external_hit_tokens(request_id) == 64
    check_quiescent(harness)
