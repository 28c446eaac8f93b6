"""Random jobs on a real `OffloadWorker` across steps, checked against a byte model (SPEC §7).

Jobs of every route (GPU ↔ CPU, GPU ↔ DISK, CPU ↔ DISK) stay in flight across steps:
disk I/O is held at a gate for a while, reports are taken at random times, the engine
writes GPU blocks no job uses (a forward pass), the disk fails writes or reads (an
errno, short transfers) for a few steps, and slots are corrupted on the file. Plans keep
the scheduler's promise (`FakeWorker._check_no_overlap`): no block is written while
another job in flight reads or writes it. Checked on every report:

- each event is reported once, done or failed, and only after it was submitted;
- a done load (or promotion, or demotion, or store) put exactly its sources' bytes in
  its destinations, as seen right when the report is taken (no report before the bytes
  landed), checked for lower tiers by the loads that read them later;
- a disk slot never written, or corrupted since its write, never loads as done: the
  failure names it, and every other block of that job is copied whole;
- a job that met no fault is done.
"""

from __future__ import annotations

import errno
import random
import shutil
import tempfile
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from transfer_helpers import FaultyIO, block_bytes, kv_per_layer, make_worker

from example_counts import scaled_examples
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport
from kvtier.storage import DiskIOMode
from kvtier.transfer import OffloadWorker, WorkerConfig

NUM_GPU_BLOCKS = 16
NUM_SLOTS = {Tier.CPU: 6, Tier.DISK: 8}
ROUTES = [
    (Tier.GPU, Tier.CPU),
    (Tier.CPU, Tier.GPU),
    (Tier.GPU, Tier.DISK),
    (Tier.DISK, Tier.GPU),
    (Tier.CPU, Tier.DISK),
    (Tier.DISK, Tier.CPU),
]
ANY = "any"  # a slot whose bytes no check may rely on (a failed copy's destination)
UNWRITTEN = "unwritten"  # a disk slot never written: no load of it may be done
CORRUPT = "corrupt"  # a disk slot changed on the file since its write: likewise
Block = tuple[Tier, int]
Content = bytes | str


@dataclass(slots=True)
class _Flight:
    job: TransferJob
    sources: list[Content]  # the model's content of each source at submission
    faulted: bool  # a disk fault was armed at some point while it was in flight


class WorkerJobsMachine(RuleBasedStateMachine):
    """One real worker (CPU tensors, host tier, page-cache disk tier) and its model."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: OffloadWorker | None = None
        self.directory = tempfile.mkdtemp(prefix="kvtier-random-jobs-")
        self.io = FaultyIO()
        self.slots: dict[Block, Content] = {}
        self.in_flight: dict[int, _Flight] = {}
        self.next_event_id = 1

    @initialize(buffer_slots=st.integers(1, 3), batch_slots=st.integers(1, 3))
    def setup(self, buffer_slots: int, batch_slots: int) -> None:
        # Two layers, K and V apart, 1 KiB each: 4 KiB slots.
        self.kv = kv_per_layer(2, NUM_GPU_BLOCKS, (16, 2, 16))
        cfg = WorkerConfig(
            cpu_num_slots=NUM_SLOTS[Tier.CPU],
            disk_num_slots=NUM_SLOTS[Tier.DISK],
            disk_path=self.directory,
            disk_io_mode=DiskIOMode.PAGE_CACHE,
            disk_buffer_slots=buffer_slots,
            disk_batch_bytes=batch_slots * 4096,
        )
        self.worker = make_worker(cfg, self.kv, self.io)
        self.slots = {(Tier.CPU, s): ANY for s in range(NUM_SLOTS[Tier.CPU])}
        self.slots.update({(Tier.DISK, s): UNWRITTEN for s in range(NUM_SLOTS[Tier.DISK])})
        for block in range(1, NUM_GPU_BLOCKS):
            self.forward(block, random.Random(block))

    # ------------------------------------------------------------ the rule

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed: int) -> None:
        """A few actions in random order: submit a plan, take a report, run a forward
        pass, hold or release disk I/O, arm or clear a fault, corrupt a slot, flush."""
        rng = random.Random(seed)
        for _ in range(rng.randint(1, 4)):
            action = rng.choice(["plan"] * 4 + ["poll"] * 3 + ["forward", "gate", "fault"] * 2)
            if action == "plan":
                self.submit(rng)
            elif action == "poll":
                self.poll()
            elif action == "forward":
                busy = set().union(*self.busy())
                free = [b for b in range(1, NUM_GPU_BLOCKS) if (Tier.GPU, b) not in busy]
                for block in rng.sample(free, min(len(free), rng.randint(1, 4))):
                    self.forward(block, rng)
            elif action == "gate":
                self.hold_disk(rng.randrange(2) == 0)
            elif action == "fault":
                self.arm_fault(rng)
        if rng.randrange(6) == 0:
            self.corrupt(rng)
        if rng.randrange(8) == 0:
            note("flush")
            self.hold_disk(False)
            self.require_worker().flush()
        self.poll()

    # ------------------------------------------------------------ actions

    def submit(self, rng: random.Random) -> None:
        """Submit a plan of 1-3 jobs that keeps the scheduler's promise."""
        worker = self.require_worker()
        need_flush = rng.randrange(8) == 0
        if need_flush:
            self.hold_disk(False)  # the flush waits for the disk
        reads, writes = self.busy()
        jobs = []
        for _ in range(rng.randint(1, 3)):
            src_tier, dst_tier = rng.choice(ROUTES)
            src = [b for b in self.blocks(src_tier) if b not in writes]
            dst = [b for b in self.blocks(dst_tier) if b not in reads | writes]
            num = min(len(src), len(dst), rng.randint(1, 4))
            if src_tier is dst_tier or num == 0:
                continue
            src, dst = rng.sample(src, num), rng.sample(dst, num)
            reads.update(src)
            writes.update(dst)
            event_id = self.next_event_id
            self.next_event_id += 1
            src_ids, dst_ids = tuple(b for _, b in src), tuple(b for _, b in dst)
            jobs.append(TransferJob(event_id, src_tier, dst_tier, src_ids, dst_ids))
        plan = TransferPlan(step_id=self.next_event_id, jobs=tuple(jobs), need_flush=need_flush)
        note(f"submit {plan}")
        if need_flush:  # every job in flight is done by the time the plan's jobs start
            for flight in self.in_flight.values():
                flight.faulted |= self.faults_armed()
        faulted = self.faults_armed()
        for job in jobs:
            sources = [self.content(job.src_tier, b) for b in job.src_block_ids]
            self.in_flight[job.event_id] = _Flight(job, sources, faulted)
        worker.submit(plan)

    def poll(self) -> None:
        """Take a report and check it against the model."""
        report = self.require_worker().poll()
        if not report.is_empty:
            note(f"report done={dict(report.done)} failed={dict(report.failed)}")
        self.check_report(report)

    def forward(self, block: int, rng: random.Random) -> None:
        """The engine writes GPU block `block` (no job in flight uses it)."""
        for view in self.require_worker().regions.block_views():
            row = torch.tensor(list(rng.randbytes(view.shape[1])), dtype=torch.uint8)
            view[block].copy_(row)

    def hold_disk(self, hold: bool) -> None:
        """Hold every disk read and write at the gate, or let them through."""
        if hold and self.io.gate.is_set():
            note("hold disk I/O")
            self.io.gate.clear()
        elif not hold and not self.io.gate.is_set():
            note("release disk I/O")
            self.io.gate.set()

    def arm_fault(self, rng: random.Random) -> None:
        """Clear the disk's faults, or arm one: an errno or short transfers."""
        io = self.io
        io.write_errno = io.read_errno = None
        io.short_reads = io.short_writes = False
        fault = rng.choice(["none", "none", "write", "read", "short_write", "short_read"])
        note(f"disk fault: {fault}")
        if fault == "write":
            io.write_errno = rng.choice([errno.EIO, errno.ENOSPC])
        elif fault == "read":
            io.read_errno = errno.EIO
        io.short_writes = fault == "short_write"
        io.short_reads = fault == "short_read"
        if self.faults_armed():
            for flight in self.in_flight.values():
                flight.faulted = True

    def corrupt(self, rng: random.Random) -> None:
        """Flip a byte of a written disk slot no job in flight uses."""
        reads, writes = self.busy()
        written = [
            b
            for b in self.blocks(Tier.DISK)
            if isinstance(self.slots[b], bytes) and b not in reads | writes
        ]
        if not written:
            return
        _, slot = rng.choice(written)
        note(f"corrupt disk slot {slot}")
        worker = self.require_worker()
        assert worker.disk_path is not None
        offset = slot * worker.bytes_per_slot + rng.randrange(worker.bytes_per_slot)
        with open(worker.disk_path, "r+b") as raw:
            raw.seek(offset)
            value = raw.read(1)[0]
            raw.seek(offset)
            raw.write(bytes([value ^ 0x5A]))
        self.slots[(Tier.DISK, slot)] = CORRUPT

    # ------------------------------------------------------------ the model

    def check_report(self, report: WorkerReport) -> None:
        assert not report.done.keys() & report.failed.keys(), "an event both done and failed"
        for event_id in [*report.done, *report.failed]:
            assert event_id in self.in_flight, f"event {event_id} reported twice or unknown"
        for event_id in report.failed:
            flight = self.in_flight.pop(event_id)
            self.settle_failed(flight, report.bad_blocks.get(event_id))
        for event_id in report.done:
            flight = self.in_flight.pop(event_id)
            job = flight.job
            for src, want in zip(job.src_block_ids, flight.sources, strict=True):
                assert want not in (UNWRITTEN, CORRUPT), (
                    f"event {event_id} done, reading {job.src_tier.value} slot {src} ({want})"
                )
            self.settle(job, job.dst_block_ids, flight.sources)

    def settle_failed(self, flight: _Flight, bad: frozenset[int] | None) -> None:
        """A failed job: check it could fail; its destinations hold what no check uses,
        but for the blocks a failure naming its bad slots copied whole."""
        job = flight.job
        sources = dict(zip(job.src_block_ids, flight.sources, strict=True))
        invalid = {b for b, content in sources.items() if content in (UNWRITTEN, CORRUPT)}
        # A failed store's disk slot may hold no valid data (ANY) and fail its loads.
        unsure = {b for b, content in sources.items() if content == ANY}
        may_fail = flight.faulted or invalid or (job.src_tier is Tier.DISK and unsure)
        assert may_fail, f"event {job.event_id} failed with no fault"
        if bad is None:
            for block in job.dst_block_ids:
                self.slots[(job.dst_tier, block)] = ANY
            return
        assert job.src_tier is Tier.DISK, f"event {job.event_id} names bad non-disk blocks"
        assert invalid <= bad or flight.faulted, f"event {job.event_id}: bad blocks {bad}"
        assert bad <= invalid | unsure or flight.faulted, f"event {job.event_id}: {bad} bad"
        whole = [i for i, b in enumerate(job.src_block_ids) if b not in bad]
        for i, block in enumerate(job.dst_block_ids):
            if i not in whole:
                self.slots[(job.dst_tier, block)] = ANY
        self.settle(job, [job.dst_block_ids[i] for i in whole], [flight.sources[i] for i in whole])

    def settle(
        self, job: TransferJob, dst_ids: list[int] | tuple[int, ...], sources: list[Content]
    ) -> None:
        """Copies that landed whole: GPU destinations checked now, slots remembered."""
        for block, want in zip(dst_ids, sources, strict=True):
            if job.dst_tier is not Tier.GPU:
                self.slots[(job.dst_tier, block)] = want
            elif isinstance(want, bytes):
                got = block_bytes(self.require_worker().regions, block)
                assert got == want, f"event {job.event_id}: GPU block {block} holds wrong bytes"

    def content(self, tier: Tier, block: int) -> Content:
        if tier is Tier.GPU:
            return block_bytes(self.require_worker().regions, block)
        return self.slots[(tier, block)]

    def busy(self) -> tuple[set[Block], set[Block]]:
        """Return the blocks the jobs in flight read, and those they write."""
        reads: set[Block] = set()
        writes: set[Block] = set()
        for flight in self.in_flight.values():
            job = flight.job
            reads.update((job.src_tier, b) for b in job.src_block_ids)
            writes.update((job.dst_tier, b) for b in job.dst_block_ids)
        return reads, writes

    @staticmethod
    def blocks(tier: Tier) -> list[Block]:
        first = 1 if tier is Tier.GPU else 0  # GPU block 0 is the null block
        return [(tier, b) for b in range(first, NUM_SLOTS.get(tier, NUM_GPU_BLOCKS))]

    def faults_armed(self) -> bool:
        io = self.io
        return bool(io.write_errno or io.read_errno or io.short_reads or io.short_writes)

    def require_worker(self) -> OffloadWorker:
        assert self.worker is not None
        return self.worker

    @invariant()
    def worker_is_consistent(self) -> None:
        if self.worker is not None:
            self.worker.check_invariants()

    def teardown(self) -> None:
        """Let everything finish; every job is reported; shut down."""
        try:
            if self.worker is not None:
                self.hold_disk(False)
                self.worker.flush()
                self.poll()
                assert not self.in_flight, f"never reported: {sorted(self.in_flight)}"
        finally:
            self.io.gate.set()
            if self.worker is not None:
                self.worker.shutdown()
            shutil.rmtree(self.directory, ignore_errors=True)


WorkerJobsMachine.TestCase.settings = settings(
    max_examples=scaled_examples(200),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_jobs_land_whole_before_they_are_reported = WorkerJobsMachine.TestCase
