"""Random operation sequences through vLLM's real scheduler with `KVTierConnector`.

The scenario tests drive the connector through one situation each; here Hypothesis
interleaves them. Each example builds a small engine (15 usable GPU blocks, a small
tier: shared prefixes leave vLLM's GPU cache and come back from kvtier's tier) and
applies random operations: add requests sharing whole-block prefixes, step, drain,
abort a live request, reset vLLM's prefix cache (GPU only, with running requests
preempted, kvtier's tier, both), delay a kind of transfer, fail the next one of a kind.
`FaultyWorker` really starts transfers late and reports them later still, so a GPU block
reused under a store or a load shows up as wrong KV; a failed load leaves zeroes in its
GPU blocks, a failed store leaves its tier slot unwritten. Each poll waits for the
copies started, so examples replay exactly (`derandomize`: CI runs the same ones).

Checked: after every step kvtier's scheduler invariants (pins, in-flight keys, pools)
and that the connector tracks exactly vLLM's live requests, after every operation the
workers' invariants too; every position vLLM treats as computed (the harness raises
`KVMismatchError`). At the end every request is finished or aborted and the engine
drained: nothing pinned, tracked or allocated. Then every block a tier indexes is
copied out and checked against its key, and every prompt replayed from a zeroed GPU
cache. Per engine (eager, lazy, write-through cascade, two ranks with write-back) the
examples must add up to tier hits, failed transfers, late ones, preemptions, aborts
and resets, so the test cannot pass by not exercising them. About 20 s on 2 cores.
"""

from __future__ import annotations

import collections
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_vllm import SLOT_BYTES, check_quiescent, kvtier_harness, offload_worker, scheduler_side
from vllm.v1.request import RequestStatus
from vllm_engine import PrefixFingerprints
from vllm_harness import ConnectorWorker

from kvtier.core.keys import key_block_hash
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.transfer.worker import OffloadWorker

BLOCK = 16
NUM_FAMILIES = 5
MAX_PREFIX_BLOCKS = 4
FAMILIES = [
    [random.Random(family).randrange(1000, 30000) for _ in range(MAX_PREFIX_BLOCKS * BLOCK)]
    for family in range(NUM_FAMILIES)
]
KINDS = ("load", "store", "move")  # move: a CPU -> DISK demotion (the cascade)
MAX_DRAIN_STEPS = 600
AUDIT_EVENT_ID = 10**9  # event ids of the tier audit's copies, far above kvtier's


# --------------------------------------------------------------------------- faults


def job_kind(job: TransferJob) -> str:
    if job.is_load:
        return "load"
    return "store" if job.is_store else "move"


@dataclass
class _Job:
    start: int  # the poll at which it starts
    hold: int  # polls between its end and its report
    plan: TransferPlan  # this one job
    fail: bool


class FaultyWorker:
    """Wrap one rank's `OffloadWorker`: run jobs late, report them late, fail some.

    `delay[kind]` polls pass between a job's submission and its start, `hold[kind]`
    between its end and its report. Each direction (loads; stores and moves: the
    worker's two lanes) starts and reports its jobs in submission order. Every poll
    first waits for the jobs started, so runs are deterministic. `fail[kind]` jobs of
    that kind from now on never run and are reported failed; a failed load also zeroes
    its GPU destination blocks (the copy half landed). `flush` (vLLM preempted a
    request) starts every queued job and waits for it; reports may still be held.
    """

    def __init__(self, worker: OffloadWorker, scribble: Callable[[tuple[int, ...]], None]):
        self._submit = worker.submit
        self._poll = worker.poll
        self._flush = worker.flush
        self._scribble = scribble
        self.delay = dict.fromkeys(KINDS, 0)
        self.hold = dict.fromkeys(KINDS, 0)
        self.fail: collections.Counter[str] = collections.Counter()
        self.num_failed: collections.Counter[str] = collections.Counter()
        self.num_run = 0
        self.num_late = 0  # jobs started or reported at least one poll late
        self._queues: dict[bool, list[_Job]] = {True: [], False: []}  # by is_load
        self._holds: dict[int, tuple[bool, int]] = {}  # running event -> direction, hold
        self._reports: dict[bool, list[tuple[int, int, bool]]] = {True: [], False: []}
        self._polls = 0
        worker.submit = self.submit  # type: ignore[method-assign]
        worker.poll = self.poll  # type: ignore[method-assign]
        worker.flush = self.flush  # type: ignore[method-assign]

    def submit(self, plan: TransferPlan) -> None:
        if plan.need_flush:
            self.flush()
        for job in plan.jobs:
            kind = job_kind(job)
            queue = self._queues[job.is_load]
            start = max(self._polls + self.delay[kind], queue[-1].start if queue else 0)
            fail = self.fail[kind] > 0
            self.fail[kind] -= fail
            self.num_late += start > self._polls or self.hold[kind] > 0
            queue.append(_Job(start, self.hold[kind], replace(plan, jobs=(job,)), fail))
        self._start(self._polls)

    def poll(self) -> WorkerReport:
        now = self._polls
        self._start(now)
        self._flush()
        ended = self._poll()
        outcomes = [(e, False) for e in ended.done] + [(e, True) for e in ended.failed]
        for event_id, failed in outcomes:
            is_load, hold = self._holds.pop(event_id)
            self._report_at(is_load, now + hold, event_id, failed)
        self._polls += 1
        done: dict[int, int] = {}
        failed_now: dict[int, int] = {}
        for reports in self._reports.values():
            while reports and reports[0][0] <= now:
                _, event_id, failed = reports.pop(0)
                (failed_now if failed else done)[event_id] = 1
        return WorkerReport(done, failed_now)

    def flush(self) -> None:
        self._start(None)
        self._flush()

    def _start(self, now: int | None) -> None:
        for is_load, queue in self._queues.items():
            while queue and (now is None or queue[0].start <= now):
                item = queue.pop(0)
                (job,) = item.plan.jobs
                if not item.fail:
                    self._holds[job.event_id] = (is_load, item.hold)
                    self._submit(replace(item.plan, need_flush=False))
                    self.num_run += 1
                    continue
                if job.is_load:
                    self._scribble(job.dst_block_ids)
                self._report_at(is_load, self._polls + item.hold, job.event_id, True)
                self.num_failed[job_kind(job)] += 1

    def _report_at(self, is_load: bool, poll: int, event_id: int, failed: bool) -> None:
        reports = self._reports[is_load]
        reports.append((max(poll, reports[-1][0] if reports else 0), event_id, failed))

    @property
    def is_idle(self) -> bool:
        return not any(self._queues.values()) and not any(self._reports.values())

    def copy_now(self, job: TransferJob) -> None:
        """Run `job` past kvtier (idle worker only): start it, wait, swallow its report."""
        assert self.is_idle
        self._submit(TransferPlan(step_id=0, jobs=(job,)))
        self._flush()
        assert self._poll() == WorkerReport(done={job.event_id: 1})


# --------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class Add:
    """Add `count` requests: `num_blocks` whole blocks of a family's prefix, then a tail."""

    count: int
    family: int
    num_blocks: int
    tail_len: int
    tail_seed: int  # few seeds: equal tails (and so whole equal prompts) recur
    max_tokens: int

    def prompts(self) -> list[list[int]]:
        prefix = FAMILIES[self.family][: self.num_blocks * BLOCK]
        prompts = []
        for i in range(self.count):
            tail = random.Random(self.tail_seed + i)
            prompts.append(prefix + [tail.randrange(1000, 30000) for _ in range(self.tail_len)])
        return prompts


@dataclass(frozen=True)
class Step:
    num_steps: int


@dataclass(frozen=True)
class Drain:
    """Step until vLLM is idle (bounded): what came before is finished and stored."""


@dataclass(frozen=True)
class Abort:
    pick: int  # index into the live requests, sorted by id (mod their number)


@dataclass(frozen=True)
class Reset:
    what: str  # gpu | gpu_running | connector | both


@dataclass(frozen=True)
class Delay:
    """From now on start `kind` jobs `start` polls late and report them `hold` polls late."""

    kind: str
    start: int
    hold: int
    rank: int


@dataclass(frozen=True)
class Fail:
    kind: str
    rank: int


RANKS = st.integers(0, 1)
STEPS = st.builds(Step, st.integers(1, 8))
ADDS = st.builds(
    Add,
    st.integers(1, 3),
    st.integers(0, NUM_FAMILIES - 1),
    st.integers(0, MAX_PREFIX_BLOCKS),
    st.sampled_from([0, 5, 16, 21]),
    st.integers(0, 2),
    st.integers(1, 32),
)
# Adds and steps three times as likely as each other kind of operation (`one_of` would
# fold repeated strategies into one).
OP_KINDS = [
    *[ADDS] * 3,
    *[STEPS] * 3,
    st.just(Drain()),
    st.builds(Abort, st.integers(0, 7)),
    st.builds(Reset, st.sampled_from(["gpu", "gpu_running", "connector", "both"])),
    st.builds(Delay, st.sampled_from(KINDS), st.integers(0, 3), st.integers(0, 3), RANKS),
    st.builds(Fail, st.sampled_from(KINDS), RANKS),
]
OPS = st.sampled_from(OP_KINDS).flatmap(lambda kind: kind)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Engine:
    """One engine configuration the examples of a test run on."""

    name: str
    store_mode: str = "eager"
    cascade: str | None = None
    num_ranks: int = 1


ENGINES = [
    Engine("eager"),
    Engine("lazy", store_mode="lazy"),
    Engine("write_through", cascade="write_through"),
    Engine("two_ranks_write_back", cascade="write_back", num_ranks=2),
]


class Run:
    """One example: a harness with a `FaultyWorker` per rank, and its bookkeeping."""

    def __init__(self, engine: Engine, totals: collections.Counter[str], disk_dir: str) -> None:
        extra: dict[str, Any] = {"store_mode": engine.store_mode}
        num_cpu_blocks = 25
        if engine.cascade is not None:
            num_cpu_blocks = 7
            extra.update(
                disk_bytes=41 * SLOT_BYTES,
                disk_path=disk_dir,
                disk_io_mode="page_cache",
                cascade=engine.cascade,
            )
        self.harness = kvtier_harness(
            num_cpu_blocks=num_cpu_blocks,
            num_gpu_blocks=16,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            num_ranks=engine.num_ranks,
            extra=extra,
        )
        self.side = scheduler_side(self.harness)
        self.workers = [
            FaultyWorker(offload_worker(self.harness, rank), self._zeroer(rank))
            for rank in range(engine.num_ranks)
        ]
        self.totals = totals
        self.prompts: dict[str, list[int]] = {}
        self.num_audits = 0

    def _zeroer(self, rank: int) -> Callable[[tuple[int, ...]], None]:
        def scribble(block_ids: tuple[int, ...]) -> None:
            for tensor in self.harness.caches[rank].tensors.values():
                tensor[list(block_ids)] = 0

        return scribble

    def close(self) -> None:
        for worker in self.harness.workers:
            assert isinstance(worker, ConnectorWorker)
            worker.connector.shutdown()
        self.harness.close()

    # ------------------------------------------------------------------ operations

    def apply(self, op: object) -> None:
        scheduler = self.harness.scheduler
        if isinstance(op, Add):
            for prompt in op.prompts():
                request_id = f"r{len(self.prompts)}"
                self.prompts[request_id] = prompt or [7]
                self.harness.add_request(request_id, self.prompts[request_id], op.max_tokens)
        elif isinstance(op, Step):
            for _ in range(op.num_steps):
                self.step()
        elif isinstance(op, Drain):
            self.drain_steps()
        elif isinstance(op, Abort):
            live = sorted(r for r, req in scheduler.requests.items() if not req.is_finished())
            if live:
                scheduler.finish_requests(live[op.pick % len(live)], RequestStatus.FINISHED_ABORTED)
                self.totals["aborts"] += 1
        elif isinstance(op, Reset):
            self.reset(op.what)
        elif isinstance(op, Delay):
            worker = self.workers[op.rank % len(self.workers)]
            worker.delay[op.kind] = op.start
            worker.hold[op.kind] = op.hold
        elif isinstance(op, Fail):
            self.workers[op.rank % len(self.workers)].fail[op.kind] += 1
        self.check()

    def step(self) -> None:
        record = self.harness.step()
        self.totals["preemptions"] += len(record.scheduler_output.preempted_req_ids or ())
        self.check(workers=False)  # the workers' after every operation: they cost more

    def reset(self, what: str) -> None:
        scheduler = self.harness.scheduler
        if what == "gpu":
            done = scheduler.reset_prefix_cache()
        elif what == "gpu_running":
            # vLLM raises when a block is still referenced after it preempted every
            # running request: a request waiting for its load, or a store kvtier pins.
            try:
                done = scheduler.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError as error:
                if "Failed to reset KV cache" not in str(error):
                    raise
                done = False
        elif what == "connector":
            done = scheduler.reset_connector_cache()
        else:
            done = scheduler.reset_prefix_cache(reset_connector=True)
        self.totals[f"reset_{what}_{'done' if done else 'refused'}"] += 1

    def check(self, workers: bool = True) -> None:
        """Check kvtier's scheduler (and, unless told not to, its workers') invariants."""
        self.side.offload.check_invariants()
        requests = self.harness.scheduler.requests.values()
        live = sum(not request.is_finished() for request in requests)
        assert self.side.num_tracked_requests == live, "connector and vLLM disagree on requests"
        for rank in range(len(self.workers) if workers else 0):
            offload_worker(self.harness, rank).check_invariants()

    # ------------------------------------------------------------------ the end

    def finish(self, abort: bool) -> None:
        """End every request (abort or run to completion), drain, check for leaks."""
        scheduler = self.harness.scheduler
        if abort:
            live = [r for r, req in scheduler.requests.items() if not req.is_finished()]
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.drain()

    def drain_steps(self) -> None:
        """Step until vLLM is idle; fail if it is still busy after `MAX_DRAIN_STEPS`."""
        scheduler = self.harness.scheduler
        for _ in range(MAX_DRAIN_STEPS):
            if not scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"engine still busy after {MAX_DRAIN_STEPS} steps")

    def drain(self) -> None:
        self.drain_steps()
        assert all(worker.is_idle for worker in self.workers)
        check_quiescent(self.harness)

    def audit_tier(self) -> None:
        """Copy every block a tier indexes to the GPU cache of every rank and check it there.

        Each must hold the KV of the token prefix its key hashes (of some request of the
        run), whether or not a later request asks for it. Call when vLLM is idle and its
        GPU cache reset: every GPU block is scratch.
        """
        blocks = {}  # vLLM block hash -> (request, block index)
        for request in self.harness.requests.values():
            for index, block_hash in enumerate(request.block_hashes):
                blocks.setdefault(block_hash, (request, index))
        fingerprints = PrefixFingerprints()
        scratch = range(1, self.harness.cfg.num_gpu_blocks)
        for tier, pool in self.side.offload.index.pools.items():
            keys = {slot: pool.key(slot) for slot in range(1, pool.num_blocks)}
            slots = [slot for slot, key in keys.items() if key is not None]
            for start in range(0, len(slots), len(scratch)):
                batch = tuple(slots[start : start + len(scratch)])
                self.num_audits += 1
                event_id = AUDIT_EVENT_ID + self.num_audits
                job = TransferJob(event_id, tier, Tier.GPU, batch, tuple(scratch[: len(batch)]))
                for worker in self.workers:
                    worker.copy_now(job)
                for slot, gpu_block in zip(batch, scratch, strict=False):
                    request, index = blocks[key_block_hash(keys[slot])]
                    prints = fingerprints.upto(request, (index + 1) * BLOCK)[index * BLOCK :]
                    for cache in self.harness.caches:
                        cache.check(f"{tier.value} slot {slot}", [gpu_block], prints, BLOCK)
                self.totals["audited_tier_blocks"] += len(batch)

    def replay(self) -> None:
        """Serve every prompt again from an empty, zeroed GPU cache: tier blocks must be right."""
        assert self.harness.scheduler.reset_prefix_cache(), "idle, yet the GPU reset failed"
        self.audit_tier()
        for cache in self.harness.caches:
            cache.raw.zero_()
        distinct = {tuple(prompt): request_id for request_id, prompt in self.prompts.items()}
        for prompt, request_id in distinct.items():
            self.harness.add_request(f"again-{request_id}", prompt, max_tokens=1)
        self.drain()
        admissions = self.harness.admissions
        self.totals["replay_hit_tokens"] += sum(
            admissions[f"again-{r}"][1] for r in distinct.values() if f"again-{r}" in admissions
        )

    def record_totals(self) -> None:
        admissions = self.harness.admissions
        self.totals["random_hit_tokens"] += sum(
            external for r, (_, external) in admissions.items() if not r.startswith("again-")
        )
        for tier, tokens in self.side.offload.take_stats().hit_tokens.items():
            self.totals[f"hit_tokens_{tier}"] += tokens
        for worker in self.workers:
            self.totals.update({f"failed_{k}": n for k, n in worker.num_failed.items()})
            self.totals["jobs_run"] += worker.num_run
            self.totals["jobs_late"] += worker.num_late


SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.name)
def test_random_operations_serve_correct_kv_and_leak_nothing(engine: Engine) -> None:
    totals: collections.Counter[str] = collections.Counter()

    @SETTINGS
    @given(ops=st.lists(OPS, min_size=10, max_size=40), abort=st.booleans())
    def example(ops: list[object], abort: bool) -> None:
        with tempfile.TemporaryDirectory(prefix="kvtier-random-") as disk_dir:
            run = Run(engine, totals, disk_dir)
            try:
                run.check()
                for op in ops:
                    run.apply(op)
                run.finish(abort)
                run.replay()
                run.record_totals()
            finally:
                run.close()

    example()
    # The examples must have exercised what they are for (the replay aside, tier hits
    # need a prefix stored, evicted from vLLM's GPU cache and asked for again).
    print(engine.name, dict(sorted(totals.items())))
    assert totals["random_hit_tokens"] > 0, "no request took tokens from the tier"
    assert totals["replay_hit_tokens"] > 0, "the replays took nothing from the tier"
    for kind in KINDS if engine.cascade is not None else ("load", "store"):
        assert totals[f"failed_{kind}"] > 0, f"no {kind} failed"
    assert totals["jobs_late"] > 0
    assert totals["preemptions"] > 0
    assert totals["aborts"] > 0
    assert totals["reset_gpu_done"] > 0
    assert totals["reset_both_done"] + totals["reset_connector_done"] > 0
    if engine.cascade is not None:
        assert totals["hit_tokens_DISK"] > 0, "nothing came back from disk"


def test_a_load_retried_after_a_failure_recomputes_and_finishes() -> None:
    """A request whose load failed is offered no hit again: vLLM recomputes it at once.

    Found by the random test: one load event serves several requests and fails; vLLM
    puts them back to 0 computed tokens. Offering the first one a hit again (here the
    write-through disk copy of the CPU blocks whose load failed) made vLLM 0.33 wait for
    an async load it admits only beside the blocks reserved for the requests behind it,
    still waiting on the same failed load: the engine stepped forever (SPEC §6.8).
    Two 69-token prompts sharing 3 blocks and a 21-token one sharing 1 (max_tokens 1),
    stored to CPU and disk; with vLLM's GPU cache reset they come back as one load of
    4 + 4 + 1 blocks, which fails. 15 usable GPU blocks: the first request's retry needs
    5, the two behind it reserve 7, 10 are free.
    """
    engine = Engine("write_through", cascade="write_through")
    totals: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-random-") as disk_dir:
        run = Run(engine, totals, disk_dir)
        try:
            wave = [Add(2, 0, 3, 21, 0, 1), Add(1, 0, 1, 5, 0, 1)]
            for op in [*wave, Drain(), Reset("gpu"), Fail("load", 0), *wave]:
                run.apply(op)
            run.drain()
            assert totals["reset_gpu_done"] == 1
            assert run.workers[0].num_failed["load"] == 1
            run.finish(abort=False)
        finally:
            run.close()
