"""`KVTierConnector` when loads fail, requests abort mid-load, and caches are reset."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from kvtier_vllm import (
    SCHEDULING,
    PollGate,
    check_quiescent,
    drain,
    drain_collecting_stats,
    kvtier_harness,
    offload_worker,
    scheduler_side,
    zero_blocks,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus
from vllm_engine import KVGroupDef
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.adapters.vllm.views import VllmRequestView

PROMPTS = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
AGAIN = {f"again-{r}": [*p, 9] for r, p in PROMPTS.items()}


def stored_then_gpu_reset(**overrides: object) -> VllmHarness:
    """Return a harness whose tier holds 3 blocks of each prompt and whose GPU cache is empty."""
    harness = kvtier_harness(**overrides)  # type: ignore[arg-type]
    harness.run_requests(PROMPTS, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    return harness


def test_failed_loads_are_recomputed_not_served() -> None:
    harness = stored_then_gpu_reset()
    gate = PollGate(offload_worker(harness))
    gate.fail_loads(zero_blocks(harness))  # a failed copy leaves garbage behind
    for request_id, prompt in AGAIN.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    payloads = drain_collecting_stats(harness)  # KVMismatchError if garbage were served
    assert harness.finished >= set(AGAIN)
    assert gate.num_failed_loads > 0
    assert all(harness.external_hit_tokens(r) == 48 for r in AGAIN)  # offered, then failed
    counters: dict[str, int] = {}
    for payload in payloads:
        for name, value in payload["counters"].items():
            counters[name] = counters.get(name, 0) + value
    assert counters["failed_loads"] == len(AGAIN)
    assert "loaded_blocks" not in counters
    check_quiescent(harness)


def test_failed_load_fails_the_request_under_vllms_default_policy() -> None:
    harness = stored_then_gpu_reset(kv_load_failure_policy="fail")
    PollGate(offload_worker(harness)).fail_loads(zero_blocks(harness))
    harness.add_request("x", AGAIN["again-req-0"], max_tokens=3)
    errors = []
    for record in busy_steps(harness):
        for outputs in record.outputs.values():
            errors += [o.request_id for o in outputs.outputs if o.finish_reason is not None]
    assert errors == ["x"]
    assert harness.requests["x"].status == RequestStatus.FINISHED_ERROR
    check_quiescent(harness)


def losing_lookup_pins(harness: VllmHarness) -> set[str]:
    """Make every request's first lookup hit lose its pin before allocation, so kvtier
    drops that load unissued; return the ids of the requests it happened to (filled in
    as they come)."""
    side = scheduler_side(harness)
    lookup = side.lookup
    sabotaged: set[str] = set()

    def lookup_then_lose_the_pin(request: object, num_computed_tokens: int) -> tuple[int, bool]:
        result = lookup(request, num_computed_tokens)
        request_id = request.request_id  # type: ignore[attr-defined]
        if result[0] and request_id not in sabotaged:
            sabotaged.add(request_id)
            # A second lookup that offers nothing drops the first one's pin, so the
            # allocation that follows finds no pin and kvtier never issues the load.
            side.offload.lookup(VllmRequestView(request), result[0] + num_computed_tokens)
        return result

    side.lookup = lookup_then_lose_the_pin  # type: ignore[method-assign]
    return sabotaged


def test_loads_dropped_before_issue_are_echoed_as_failed_by_every_worker() -> None:
    harness = stored_then_gpu_reset(num_ranks=2)
    sabotaged = losing_lookup_pins(harness)
    harness.run_requests(AGAIN, max_tokens=3)  # hangs if nobody reports the dropped loads
    assert sabotaged == set(AGAIN)
    assert all(harness.external_hit_tokens(r) == 48 for r in AGAIN)
    check_quiescent(harness)


def test_a_load_dropped_before_issue_still_names_the_source_of_every_hit_token() -> None:
    """vLLM counts the accepted tokens of a load kvtier dropped as hits (it learns of the
    failure later) and asks which tier serves them: every token gets a source, here the
    configured tier's, though the load has no split by tier."""
    harness = stored_then_gpu_reset()
    sabotaged = losing_lookup_pins(harness)
    connector = harness.scheduler.connector
    sources = connector.get_external_cache_hit_sources  # type: ignore[union-attr]
    answers: list[tuple[int, dict[CacheHitSource, int]]] = []

    def recording(request: object, num_external_tokens: int) -> dict[CacheHitSource, int]:
        answer = sources(request, num_external_tokens)
        answers.append((num_external_tokens, answer))
        return answer

    connector.get_external_cache_hit_sources = recording  # type: ignore[union-attr]
    harness.run_requests(AGAIN, max_tokens=3)
    assert sabotaged == set(AGAIN)
    assert answers == [(48, {CacheHitSource.HOST: 48})] * len(AGAIN)
    check_quiescent(harness)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_abort_during_load_frees_blocks_only_after_the_load(scheduling: str) -> None:
    harness = stored_then_gpu_reset(**SCHEDULING[scheduling])
    gate = PollGate(offload_worker(harness))
    gate.hold("load")
    harness.add_request("b", AGAIN["again-req-1"], max_tokens=3)
    for _ in range(3):
        harness.step()
    request = harness.requests["b"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    pool = harness.scheduler.kv_cache_manager.block_pool
    for _ in range(3):
        harness.step()
        # The load may still write into the request's blocks: vLLM must not reuse them.
        assert pool.get_num_free_blocks() < harness.cfg.num_gpu_blocks - 1
    gate.release()
    drain(harness)
    assert "b" not in harness.scheduler.requests
    check_quiescent(harness)


def test_connector_reset_waits_for_issued_stores_and_never_shows_them() -> None:
    harness = kvtier_harness()
    gate = PollGate(offload_worker(harness))
    gate.hold("store")
    for request_id, prompt in PROMPTS.items():
        harness.add_request(request_id, prompt, max_tokens=3)
    for _ in range(20):
        harness.step()
    assert harness.finished == set(PROMPTS)
    assert not harness.scheduler.reset_connector_cache(), "stores are still in flight"
    gate.release()
    drain(harness)
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    harness.run_requests(AGAIN, max_tokens=3)
    assert all(harness.external_hit_tokens(r) == 0 for r in AGAIN), "abandoned stores leaked"
    check_quiescent(harness)


def test_a_connector_reset_that_reports_failure_still_serves_nothing_from_before() -> None:
    # Regression: while a store was in flight, reset_prefix_cache(reset_connector=True)
    # returned False and left the tier's index as it was: a caller that did not retry
    # (e.g. after a weight update) was served the KV from before the reset.
    harness = stored_then_gpu_reset()
    gate = PollGate(offload_worker(harness))
    gate.hold("store")
    harness.add_request("other", list(range(500, 548)), max_tokens=3)
    for _ in range(3):
        harness.step()
    assert not harness.scheduler.reset_prefix_cache(reset_connector=True), "a store in flight"
    gate.release()
    harness.run_requests(AGAIN, max_tokens=3)  # no retry of the reset
    assert all(harness.external_hit_tokens(r) == 0 for r in AGAIN), "KV from before served"
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    check_quiescent(harness)


def test_reset_prefix_cache_with_connector_empties_the_tier() -> None:
    harness = stored_then_gpu_reset()
    side = scheduler_side(harness)
    tier = side.offload.tier_pool
    assert sum(tier.is_cached(b) for b in range(1, tier.num_blocks)) == 4 * 3
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    assert not any(tier.is_cached(b) for b in range(1, tier.num_blocks))
    harness.run_requests(AGAIN, max_tokens=3)
    assert all(harness.external_hit_tokens(r) == 0 for r in AGAIN)
    check_quiescent(harness)


def test_a_load_failing_under_the_fail_policy_leaves_no_state() -> None:
    # vLLM ends the request (FINISHED_ERROR) before it hands kvtier the report that
    # carries the failure: kvtier must not hold the finished request for a recompute.
    harness = stored_then_gpu_reset(kv_load_failure_policy="fail")
    PollGate(offload_worker(harness)).fail_loads(zero_blocks(harness))
    harness.add_request("x", AGAIN["again-req-0"], max_tokens=3)
    drain(harness)
    assert harness.requests["x"].status == RequestStatus.FINISHED_ERROR
    check_quiescent(harness)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_request_aborted_during_a_load_that_then_fails_leaves_no_state(scheduling: str) -> None:
    harness = stored_then_gpu_reset(**SCHEDULING[scheduling])
    gate = PollGate(offload_worker(harness))
    gate.hold("load")
    gate.fail_loads(zero_blocks(harness))
    harness.add_request("b", AGAIN["again-req-1"], max_tokens=3)
    for _ in range(3):
        harness.step()
    assert harness.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    gate.release()
    drain(harness)
    check_quiescent(harness)


def test_a_failed_load_on_a_tight_hybrid_pool_does_not_stall_the_requests_behind_it() -> None:
    # Regression (the random hybrid test on 16 GPU blocks): two 69-token prompts come back
    # from the tier as one load of 4 blocks each, which fails. vLLM 0.33 frees the first
    # request's blocks but keeps it at the head of its queue of block-holding waiting
    # requests; its recompute needs 10 blocks (5 per group), 9 are free, and the 6 it
    # lacks belong to the second request, queued behind it and never looked at again:
    # no request ever ran. kvtier answers a failed request's next lookup with "not yet",
    # so vLLM moves it to its plain waiting queue, behind the block holders.
    run_a_failed_load_on_the_tight_hybrid_pool("fcfs", (0, 0))


def run_a_failed_load_on_the_tight_hybrid_pool(policy: str, priorities: tuple[int, int]) -> None:
    """Serve two 69-token prompts from the tier on 16 GPU blocks as one load that fails,
    the requests of vLLM scheduling `policy` at `priorities`; check that both finish
    with their hits, and that nothing leaks. The step bounds only tell a stall (which
    never ends) from slow copies: kvtier copies on real threads, and on 2 busy cores the
    store phase took up to 163 steps."""
    groups = (KVGroupDef(16), KVGroupDef(16, 32))
    harness = kvtier_harness(
        kv_groups=groups,
        num_gpu_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        scheduling_policy=policy,
    )
    prompts = shared_prefix_prompts(2, prefix_len=48, suffix_len=21, seed=3)
    harness.run_requests(prompts, max_tokens=1, max_steps=1000)
    assert harness.scheduler.reset_prefix_cache()
    gate = PollGate(offload_worker(harness))
    gate.fail_loads(zero_blocks(harness))
    again = {f"again-{r}": p for r, p in prompts.items()}
    for (request_id, prompt), priority in zip(again.items(), priorities, strict=True):
        harness.add_request(request_id, prompt, max_tokens=1, priority=priority)
    drain(harness, max_steps=1000)  # "engine still busy" when it stalls
    assert harness.finished >= set(again)
    assert gate.num_failed_loads == 1
    assert all(harness.external_hit_tokens(r) == 64 for r in again)
    check_quiescent(harness)
