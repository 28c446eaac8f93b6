"""A fake offload worker for tests: N workers that copy only when told, with a byte model.

Per worker, a dict GPU block -> content and, per lower tier, slot -> content (content: see
`sim_request.block_content`). A worker copies when it finishes its job, after checking that
the source did not change while the job was in flight (a missing pin would let it).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hypothesis import note

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import Key
from kvtier.offload.plan import TransferJob, TransferPlan, WorkerReport

GARBAGE = "garbage"  # what a failed copy leaves in its destination
SECONDS_PER_BLOCK = 0.001  # the copy time every fake worker reports for a block it copied

Content = Key | str | None


# ---------------------------------------------------------------------------- worker


@dataclass(slots=True)
class _InFlight:
    job: TransferJob
    waiting: set[int]
    sources: list[list[Content]]  # per worker: source contents at submission
    failed: bool = False  # some worker failed it


class FakeWorker:
    """N offload workers that copy only when told, with a byte model per worker."""

    def __init__(self, num_workers: int = 1, first_tier: str = "CPU") -> None:
        self.num_workers = num_workers
        self.gpu: list[dict[int, Content]] = [{} for _ in range(num_workers)]
        self.lower: dict[str, list[dict[int, Content]]] = {
            name: [{} for _ in range(num_workers)] for name in ("CPU", "DISK")
        }
        self.tier = self.lower[first_tier]  # the tier GPU blocks are stored into
        self.plans: list[TransferPlan] = []
        self.jobs: dict[int, TransferJob] = {}
        self.in_flight: dict[int, _InFlight] = {}
        self.reported: dict[int, _InFlight] = {}  # events every worker reported, in order
        self._done: Counter[int] = Counter()
        self._failed: Counter[int] = Counter()
        # Bad source blocks named by this report's failures of an event; None once one
        # failure named nothing (`WorkerReport.bad_blocks`).
        self._bad: dict[int, set[int] | None] = {}
        # Per worker, lower-tier slots corrupted since last written: a load reading one
        # fails naming it, as a checksum would tell (see `corrupt`).
        self.corrupted: list[set[tuple[str, int]]] = [set() for _ in range(num_workers)]
        self.named_by: dict[tuple[str, int], set[int]] = {}  # slot -> events naming it

    def write_gpu(self, block_id: int, content: Content) -> None:
        """Record that the forward pass wrote `content` into a GPU block (every worker)."""
        for gpu in self.gpu:
            gpu[block_id] = content

    def submit(self, plan: TransferPlan) -> None:
        """Accept a plan; its jobs stay in flight until completed or failed."""
        self.plans.append(plan)
        self._check_no_overlap(plan.jobs)
        for job in plan.jobs:
            assert job.event_id not in self.jobs, f"event id {job.event_id} repeated"
            assert max(self.jobs, default=0) < job.event_id, "event ids must increase"
            assert NULL_BLOCK_ID not in job.src_block_ids + job.dst_block_ids, "null in a plan"
            self.jobs[job.event_id] = job
            sources = [self._read(w, job.src_tier.value, job.src_block_ids) for w in self.workers]
            self.in_flight[job.event_id] = _InFlight(job, set(self.workers), sources)

    def _check_no_overlap(self, jobs: Sequence[TransferJob]) -> None:
        """Assert no block is written by one job while another reads or writes it.

        Checked at submission, so it does not depend on the order the jobs finish in: on
        a real worker a store and a load run on two lanes at once.
        """
        reads: set[tuple[str, int]] = set()
        writes: set[tuple[str, int]] = set()
        for job in [flight.job for flight in self.in_flight.values()] + list(jobs):
            src = {(job.src_tier.value, b) for b in job.src_block_ids}
            dst = {(job.dst_tier.value, b) for b in job.dst_block_ids}
            clash = dst & (reads | writes)
            assert not clash, f"event {job.event_id} writes blocks in use: {sorted(clash)}"
            clash = src & writes
            assert not clash, f"event {job.event_id} reads blocks being written: {sorted(clash)}"
            reads |= src
            writes |= dst

    @property
    def workers(self) -> range:
        return range(self.num_workers)

    def complete(self, event_id: int, workers: Iterable[int] | None = None) -> None:
        """Let `workers` (default: all still waiting) copy and report `event_id` done."""
        self._finish(event_id, workers, ok=True)

    def fail(self, event_id: int, workers: Iterable[int] | None = None) -> None:
        """Let `workers` report `event_id` failed, leaving garbage in its destinations."""
        self._finish(event_id, workers, ok=False)

    def corrupt(self, event_id: int, worker: int, bad: Iterable[int]) -> None:
        """Corrupt `worker`'s source slots `bad` of in-flight load `event_id`; it fails
        naming them once it finishes. No other in-flight event may use them (`uses`)."""
        job = self.in_flight[event_id].job
        assert job.is_load
        assert set(bad) <= set(job.src_block_ids)
        tier = job.src_tier.value
        for block in bad:
            self.lower[tier][worker][block] = GARBAGE
            self.corrupted[worker].add((tier, block))
        self.in_flight[event_id].sources[worker] = self._read(worker, tier, job.src_block_ids)

    def corrupt_or_fail(self, event_id: int, worker: int, rng: random.Random) -> None:
        """Let `worker` find some source slots of a load corrupted and fail it naming them;
        a plain failure for other jobs, or when another in-flight event uses those slots."""
        job = self.in_flight[event_id].job
        src = sorted(set(job.src_block_ids))
        bad = rng.sample(src, rng.randint(1, len(src)))
        if not job.is_load or self.uses(job.src_tier.value, bad, but=event_id):
            self.fail(event_id, [worker])
            return
        note(f"worker {worker}: event {event_id} finds slots {sorted(bad)} corrupted")
        self.corrupt(event_id, worker, bad)
        self.complete(event_id, [worker])

    def uses(self, tier_name: str, block_ids: Iterable[int], but: int) -> bool:
        """Return True if an in-flight event other than `but` reads or writes one of
        `block_ids` of `tier_name`."""
        wanted = set(block_ids)
        for event_id, flight in self.in_flight.items():
            job = flight.job
            if event_id == but:
                continue
            if job.src_tier.value == tier_name and wanted & set(job.src_block_ids):
                return True
            if job.dst_tier.value == tier_name and wanted & set(job.dst_block_ids):
                return True
        return False

    def complete_all(self) -> None:
        """Complete every in-flight job on every worker (what `flush()` waits for)."""
        for event_id in list(self.in_flight):
            self.complete(event_id)

    def duplicate(self, event_id: int) -> None:
        """Report an already fully reported event once more (e.g. across a reset)."""
        assert event_id in self.reported
        self._done[event_id] += 1

    def report_unknown(self, event_id: int) -> None:
        """Report an event this worker was never given (the scheduler must ignore it)."""
        assert event_id not in self.jobs
        self._failed[event_id] += 1

    def take_report(self) -> WorkerReport:
        """Return everything reported since the last call, merged over workers."""
        seconds = {
            e: SECONDS_PER_BLOCK * self.jobs[e].num_blocks for e in self._done if e in self.jobs
        }
        bad = {e: frozenset(b) for e, b in self._bad.items() if b and self._failed[e]}
        report = WorkerReport(
            done=dict(self._done), failed=dict(self._failed), seconds=seconds, bad_blocks=bad
        )
        self._done.clear()
        self._failed.clear()
        self._bad.clear()
        return report

    def in_flight_refs(self, tier_name: str) -> Counter[int]:
        """Count, per block of `tier_name` ("GPU" or the tier), the in-flight jobs using it."""
        refs: Counter[int] = Counter()
        for flight in self.in_flight.values():
            job = flight.job
            if job.src_tier.value == tier_name:
                refs.update(job.src_block_ids)
            if job.dst_tier.value == tier_name:
                refs.update(job.dst_block_ids)
        return refs

    def stores(self) -> list[TransferJob]:
        """Return every store job submitted so far."""
        return [job for job in self.jobs.values() if job.is_store]

    def loads(self) -> list[TransferJob]:
        """Return every load job submitted so far."""
        return [job for job in self.jobs.values() if job.is_load]

    def _space(self, worker: int, tier_name: str) -> dict[int, Content]:
        return self.gpu[worker] if tier_name == "GPU" else self.lower[tier_name][worker]

    def _read(self, worker: int, tier_name: str, block_ids: Sequence[int]) -> list[Content]:
        space = self._space(worker, tier_name)
        return [space.get(b) for b in block_ids]

    def _finish(self, event_id: int, workers: Iterable[int] | None, ok: bool) -> None:
        flight = self.in_flight[event_id]
        chosen = sorted(flight.waiting) if workers is None else sorted(workers)
        job = flight.job
        for worker in chosen:
            assert worker in flight.waiting, f"worker {worker} reports event {event_id} twice"
            now = self._read(worker, job.src_tier.value, job.src_block_ids)
            assert now == flight.sources[worker], (
                f"event {event_id}: a source block changed while the copy was in flight"
            )
            dst = self._space(worker, job.dst_tier.value)
            tier = job.src_tier.value
            found = {b for b in job.src_block_ids if (tier, b) in self.corrupted[worker]}
            for src_block, src_content, dst_block in zip(
                job.src_block_ids, now, job.dst_block_ids, strict=True
            ):
                dst[dst_block] = src_content if ok and src_block not in found else GARBAGE
                if job.dst_tier.value != "GPU":
                    self.corrupted[worker].discard((job.dst_tier.value, dst_block))
            flight.waiting.discard(worker)
            named = ok and bool(found)  # the read found corrupted slots: it names them
            flight.failed |= not ok or named
            (self._done if ok and not named else self._failed)[event_id] += 1
            if not ok:
                self._bad[event_id] = None  # a failure naming nothing
            elif named:
                for block in found:
                    self.named_by.setdefault((tier, block), set()).add(event_id)
                names = self._bad.setdefault(event_id, set())
                if names is not None:
                    names.update(found)
        if not flight.waiting:
            self.reported[event_id] = self.in_flight.pop(event_id)
