"""A load failing by block under rank skew, aborts, shared slots and vLLM's fail policy.

Two ranks load the same DISK -> GPU event; one finds a slot corrupted and reports the
GPU block it was copied into as a load error (`get_block_ids_with_load_errors`), the
other reports the event later (held for a few polls), first, or as failed without
naming blocks. vLLM's executor unites the ranks' load errors at once but reports a
request finished (or failed) only once every rank did, so the request must still be
waiting for its load whenever an error naming its block arrives. The harness checks
the KV of every position vLLM treats as computed (a kept bad block raises
`KVMismatchError`); `scan_records` checks that no load error ever touched a running
request (the ids would then name blocks vLLM gave to someone else).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    offload_worker,
)
from test_vllm_partial_load_failure import CorruptSlot
from vllm.v1.request import RequestStatus
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.offload.plan import TransferPlan, WorkerReport

PREFIX = 64


class SkewLoads:
    """Wrap one rank's `OffloadWorker.poll`: hold each finished load event back until
    `until()` holds, then `delay` polls more (its bad blocks too); with `fail_unnamed`
    report it failed naming nothing (its destinations zeroed first, as a copy that half
    landed would leave them)."""

    def __init__(
        self,
        harness: VllmHarness,
        rank: int,
        delay: int = 0,
        fail_unnamed: bool = False,
        until: Callable[[], bool] = lambda: True,
    ) -> None:
        worker = offload_worker(harness, rank)
        self.delay = delay
        self.fail_unnamed = fail_unnamed
        self.harness = harness
        self.rank = rank
        self.until = until
        self._submit, self._poll = worker.submit, worker.poll
        self._loads: dict[int, tuple[int, ...]] = {}  # event -> GPU destinations
        # event -> (polls left, failed, bad blocks or None)
        self._held: dict[int, tuple[int, bool, frozenset[int] | None]] = {}
        worker.submit = self.submit  # type: ignore[method-assign]
        worker.poll = self.poll  # type: ignore[method-assign]

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            if job.is_load:
                self._loads[job.event_id] = job.dst_block_ids
        self._submit(plan)

    def poll(self) -> WorkerReport:
        report = self._poll()
        done = {e: n for e, n in report.done.items() if e not in self._loads}
        failed = {e: n for e, n in report.failed.items() if e not in self._loads}
        seconds = dict(report.seconds)
        for event_id in report.done.keys() & self._loads.keys():
            self._held[event_id] = (self.delay, False, None)
        for event_id in report.failed.keys() & self._loads.keys():
            self._held[event_id] = (self.delay, True, report.bad_blocks.get(event_id))
        bad_blocks = {}
        for event_id, (left, is_failed, bad) in list(self._held.items()):
            if not self.until():
                continue
            if left > 0:
                self._held[event_id] = (left - 1, is_failed, bad)
                continue
            del self._held[event_id]
            if self.fail_unnamed:
                for tensor in self.harness.caches[self.rank].tensors.values():
                    tensor[list(self._loads[event_id])] = 0
                failed[event_id] = 1
            elif is_failed:
                failed[event_id] = 1
                if bad is not None:
                    bad_blocks[event_id] = bad
            else:
                done[event_id] = 1
        return WorkerReport(done=done, failed=failed, seconds=seconds, bad_blocks=bad_blocks)


def scan_records(harness: VllmHarness) -> list[tuple[bool, set[str]]]:
    """Record each of vLLM's scans for invalid blocks: (running scan?, requests hit)."""
    scheduler: Any = harness.scheduler
    scan = scheduler._update_requests_with_invalid_blocks
    records: list[tuple[bool, set[str]]] = []

    def recording(requests: Any, invalid: set[int], scheduled: Any, evict_blocks: bool = True):  # type: ignore[no-untyped-def]
        result = scan(requests, invalid, scheduled, evict_blocks)
        records.append((evict_blocks, set(result[0])))
        return result

    scheduler._update_requests_with_invalid_blocks = recording
    return records


def store_two_prefixes(
    tmp_path: Path, num_prefixes: int = 2, **overrides: Any
) -> tuple[VllmHarness, dict[str, list[int]]]:
    """Return a 2-rank harness whose disk tier holds two requests' 64-token prefixes
    (one shared prefix when `num_prefixes` is 1) and whose GPU copies are gone."""
    extra = {"cpu_bytes": 0, "disk_bytes": 256 * SLOT_BYTES, "disk_path": str(tmp_path)}
    extra["disk_io_mode"] = "page_cache"
    overrides.setdefault("num_ranks", 2)
    harness = kvtier_harness(extra=extra, **overrides)
    prompts = shared_prefix_prompts(2, prefix_len=PREFIX, suffix_len=8, num_prefixes=num_prefixes)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()
    for cache in harness.caches:
        cache.raw.zero_()
    return harness, prompts


def run(harness: VllmHarness) -> tuple[dict[str, int], dict[str, list[int]], dict[str, Any]]:
    """Step until idle; return each request's computed tokens when first scheduled, its
    output tokens and its finish reason."""
    computed: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, Any] = {}
    for _ in range(3000):
        if not harness.is_busy():
            break
        record = harness.drain_step()
        for new in record.scheduler_output.scheduled_new_reqs:
            computed.setdefault(new.req_id, new.num_computed_tokens)
        for engine_outputs in record.outputs.values():
            for out in engine_outputs.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
    assert not harness.is_busy()
    return computed, outputs, reasons


@dataclass
class RankLog:
    """Each rank's load reports, by step: (step, rank, invalid ids, finished, failed)."""

    entries: list[tuple[int, int, set[int], set[str], set[str]]] = field(default_factory=list)

    def first(self, rank: int, what: int) -> int | None:
        """Return the first step `rank` reported something in field `what` (2: load
        errors, 3: finished, 4: failed), or None."""
        return next((e[0] for e in self.entries if e[1] == rank and e[what]), None)


def log_ranks(harness: VllmHarness) -> RankLog:
    log = RankLog()
    for rank, worker in enumerate(harness.workers):
        after = worker.after_forward  # type: ignore[attr-defined]

        def logged(scheduler_output: Any, after: Any = after, rank: int = rank) -> Any:
            out = after(scheduler_output)
            if out is not None:
                entry = (
                    harness.num_steps,
                    rank,
                    set(out.invalid_block_ids),
                    set(out.finished_recving or ()),
                    set(out.failed_recving or ()),
                )
                log.entries.append(entry)
            return out

        worker.after_forward = logged  # type: ignore[attr-defined]
    return log


def serve(
    tmp_path: Path,
    fault: tuple[int, int] | None,
    skew: Callable[[VllmHarness, RankLog], Any] | None = None,
    num_prefixes: int = 2,
    **overrides: Any,
) -> tuple[VllmHarness, dict[str, int], dict[str, list[int]], CorruptSlot | None, RankLog]:
    """Serve the two prompts again from disk; `fault`: (request, block) corrupted on
    rank 1; `skew(harness, log)` wraps a rank's worker (`SkewLoads`)."""
    harness, prompts = store_two_prefixes(tmp_path, num_prefixes, **overrides)
    log = log_ranks(harness)
    records = scan_records(harness)
    corrupt = None
    if fault is not None:
        corrupt = CorruptSlot(offload_worker(harness, rank=1), *fault)
    if skew is not None:
        skew(harness, log)
    for request_id, prompt in prompts.items():
        harness.add_request(f"again-{request_id}", [*prompt, 9], max_tokens=3)
    computed, outputs, _ = run(harness)
    assert all(not hit for running, hit in records if running), "a running request was hit"
    return harness, computed, outputs, corrupt, log


@pytest.fixture(scope="module")
def clean_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    harness, computed, outputs, _, _ = serve(tmp_path_factory.mktemp("clean"), None)
    harness.close()
    assert set(computed.values()) == {PREFIX}
    return outputs


def late(
    rank: int, delay: int, fail_unnamed: bool = False
) -> Callable[[VllmHarness, RankLog], Any]:
    """Hold `rank`'s load reports until the other rank reported its loads, then
    `delay` polls more."""
    other = 1 - rank

    def wrap(harness: VllmHarness, log: RankLog) -> SkewLoads:
        until = lambda: log.first(other, 3) is not None  # noqa: E731
        return SkewLoads(harness, rank, delay, fail_unnamed, until)

    return wrap


@pytest.mark.parametrize("delay", [0, 3])
@pytest.mark.parametrize("late_rank", [0, 1], ids=["good-rank-late", "bad-rank-late"])
@pytest.mark.parametrize("scheduling", ["sync", "async_pipelined"])
def test_ranks_reporting_in_different_steps_keep_the_prefix(
    tmp_path: Path,
    clean_outputs: dict[str, list[int]],
    late_rank: int,
    delay: int,
    scheduling: str,
) -> None:
    harness, computed, outputs, corrupt, log = serve(
        tmp_path, (1, 2), late(late_rank, delay), **SCHEDULING[scheduling]
    )
    assert corrupt is not None
    assert corrupt.gpu_block is not None
    bad, good = corrupt.request_ids[1], corrupt.request_ids[0]
    errors, finished_good = log.first(1, 2), log.first(0, 3)
    assert errors is not None
    assert finished_good is not None
    assert (errors < finished_good) if late_rank == 0 else (errors >= finished_good)
    assert computed == {bad: 32, good: PREFIX}
    if scheduling == "sync":
        assert outputs == clean_outputs
    check_quiescent(harness)
    harness.close()


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_rank_failing_the_event_unnamed_recomputes_both_whole(
    tmp_path: Path, clean_outputs: dict[str, list[int]], late_rank: int
) -> None:
    """Rank 1 names the bad slot (a load error by block); rank 0 fails the same event
    without names (an I/O error), before or after: every request of it recomputes all."""

    def skew(harness: VllmHarness, log: RankLog) -> SkewLoads:
        until = (lambda: log.first(1, 3) is not None) if late_rank == 0 else lambda: True
        if late_rank == 1:
            SkewLoads(harness, 1, 0, False, lambda: log.first(0, 3) is not None)
        return SkewLoads(harness, 0, 0, True, until)

    harness, computed, outputs, corrupt, log = serve(tmp_path, (0, 2), skew)
    assert corrupt is not None
    assert corrupt.gpu_block is not None
    assert log.first(1, 2) is not None
    assert log.first(0, 4) is not None
    assert set(computed.values()) == {0}
    assert outputs == clean_outputs
    check_quiescent(harness)
    harness.close()


@pytest.mark.parametrize("block", [0, 2])
def test_two_requests_reading_one_bad_slot_both_stop_before_it(tmp_path: Path, block: int) -> None:
    """Both requests share their prefix, loaded in one event from the same slots."""
    clean, _, clean_out, _, _ = serve(tmp_path / "clean", None, num_prefixes=1)
    clean.close()
    harness, computed, outputs, corrupt, log = serve(tmp_path / "bad", (0, block), num_prefixes=1)
    assert corrupt is not None
    assert corrupt.gpu_block is not None
    invalid = set().union(*(e[2] for e in log.entries))
    assert len(invalid) == 2  # each request's own copy of the bad slot
    # Both stop before it; one truncated at 0 may then hit the other's recompute locally.
    assert min(computed.values()) == 16 * block
    assert block == 0 or set(computed.values()) == {16 * block}
    assert outputs == clean_out
    check_quiescent(harness)
    harness.close()


def test_the_kept_and_recomputed_prefix_is_served_from_the_gpu_cache_after(
    tmp_path: Path,
) -> None:
    harness, computed, _, corrupt, _ = serve(tmp_path, (1, 1))
    assert corrupt is not None
    bad = corrupt.request_ids[1]
    assert computed[bad] == 16
    prompt = harness.requests[bad].prompt_token_ids
    assert prompt is not None
    harness.add_request("third", [*prompt[:PREFIX], 5, 6, 7], max_tokens=2)
    run(harness)  # KVMismatchError if a cached block held the bad slot's garbage
    assert harness.local_hit_tokens("third") == PREFIX
    check_quiescent(harness)
    harness.close()


@pytest.mark.parametrize("aborted", [0, 1])
@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_request_aborted_while_its_bad_load_is_in_flight(
    tmp_path: Path, aborted: int, late_rank: int
) -> None:
    """Abort one request while a rank holds its load back; its load error arrives
    after the abort, while others take freed blocks: nobody else is truncated."""
    harness, prompts = store_two_prefixes(tmp_path)
    log = log_ranks(harness)
    records = scan_records(harness)
    corrupt = CorruptSlot(offload_worker(harness, rank=1), 1, 1)
    gate = {"open": False}
    SkewLoads(harness, late_rank, 0, False, lambda: gate["open"])
    for request_id, prompt in prompts.items():
        harness.add_request(f"again-{request_id}", [*prompt, 9], max_tokens=3)
    for _ in range(200):
        harness.drain_step()
        if late_rank == 1 or log.first(1, 2) is not None:
            break
    assert corrupt.gpu_block is not None
    victim = corrupt.request_ids[aborted]
    assert harness.requests[victim].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    others = shared_prefix_prompts(3, prefix_len=40, suffix_len=8, num_prefixes=3, seed=7)
    for request_id, prompt in others.items():
        harness.add_request(f"other-{request_id}", prompt, max_tokens=4)
    for _ in range(4):
        harness.step()
    gate["open"] = True
    run(harness)
    assert log.first(1, 2) is not None
    assert all(not hit for running, hit in records if running), "a running request was hit"
    assert {f"other-{r}" for r in others} <= harness.finished
    check_quiescent(harness)
    harness.close()


def test_the_fail_policy_fails_only_the_request_that_read_the_bad_slot(tmp_path: Path) -> None:
    harness, computed, outputs, corrupt, _ = serve(
        tmp_path, (1, 2), late(0, 2), kv_load_failure_policy="fail"
    )
    assert corrupt is not None
    bad, good = corrupt.request_ids[1], corrupt.request_ids[0]
    assert harness.requests[bad].status == RequestStatus.FINISHED_ERROR
    assert bad not in computed
    assert computed[good] == PREFIX
    assert len(outputs[good]) == 3
    check_quiescent(harness)
    harness.close()
