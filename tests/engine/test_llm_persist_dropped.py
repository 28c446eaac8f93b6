"""Disk copies the offload scheduler dropped or never registered stay dropped after a restart.

The scheduler drops a disk copy's keys when a load reading it fails (suspect), and it
does not register a demotion whose CPU source lost its keys to a failed load while the
demotion was in flight (the bytes copied are suspect too). Regression: the slots'
manifest records survived both, so a restarted engine restored those keys and served
them (for a demotion of a suspect CPU copy: possibly wrong KV).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvtier.core.keys import Key
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport

MODEL = ModelConfig.tiny()
BLOCK_BYTES = MODEL.kv_bytes_per_token() * 4  # block size 4
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=24, keep_logits=True)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
PROMPT = list(range(3, 3 + 21))  # five whole blocks


def persistent(tmp_path: Path, cascade: bool, token_check: bool = False) -> OffloadConfig:
    """A persistent disk tier (page cache), behind a write-through CPU tier if `cascade`."""
    return OffloadConfig(
        token_check=token_check,
        cpu_bytes=16 * BLOCK_BYTES if cascade else 0,
        disk_bytes=32 * BLOCK_BYTES,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        cascade=CascadeMode.WRITE_THROUGH,
    )


class Faults:
    """Wrap a worker: jobs `fail(job)` picks are not run and are reported failed (every
    block suspect); while `hold` is set, reports of CPU -> DISK events are held back,
    and given out by the first poll after one that reported a failure."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.fail: Callable[[TransferJob], bool] = lambda job: False
        self.hold = False
        self.demotions: set[int] = set()
        self.held: list[WorkerReport] = []
        self.failing: dict[int, int] = {}
        self.failed_once = False
        self.released = 0  # held demotion events given out after a failure

    def submit(self, plan: TransferPlan) -> None:
        kept = []
        for job in plan.jobs:
            if self.fail(job):
                self.failing[job.event_id] = 1
            else:
                kept.append(job)
                if self.hold and job.src_tier is Tier.CPU and job.dst_tier is Tier.DISK:
                    self.demotions.add(job.event_id)
        self.worker.submit(dataclasses.replace(plan, jobs=tuple(kept)))

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        if self.demotions:
            held = {e: n for e, n in report.done.items() if e in self.demotions}
            if held:
                self.held.append(WorkerReport(done=held))
                done = {e: n for e, n in report.done.items() if e not in held}
                report = dataclasses.replace(report, done=done)
        if self.held and self.failed_once:
            report = WorkerReport.merge([report, *self.held])
            self.released += sum(len(held.done) for held in self.held)
            self.held, self.demotions = [], set()
        if self.failing:
            report = WorkerReport.merge([report, WorkerReport(failed=self.failing)])
            self.failing = {}
            self.failed_once = True
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def evict_gpu(llm: LLM) -> None:
    """Drop every cached GPU block no request holds, so the next prompt loads from the tiers."""
    pool = llm.pool
    for block_id in range(1, pool.num_blocks):
        if pool.is_cached(block_id) and pool.ref_count(block_id) == 0:
            pool.evict_keys(block_id)


F = TypeVar("F", bound=Faults)


def held_on_the_tiers_only(llm: LLM, wrap: Callable[[Any], F]) -> F:
    """Wrap the engine's worker in `wrap(worker)`, serve PROMPT, wait for its stores and
    evict it from the GPU (its next request loads it from the tiers); return the wrapper."""
    assert llm.offload is not None
    faults = wrap(llm.offload.worker)
    llm.offload.worker = faults  # type: ignore[assignment]
    llm.generate([PROMPT], PARAMS)
    llm.drain()
    evict_gpu(llm)
    return faults


def step_until_its_disk_load_failed(
    llm: LLM, faults: Faults, *suppressed: type[BaseException]
) -> None:
    """Request PROMPT with its loads from disk failing, and step until the report that
    failed them (10 steps at most; `suppressed` errors of a step ignored)."""
    faults.fail = lambda job: job.src_tier is Tier.DISK
    llm.add_request(PROMPT, PARAMS)
    for _ in range(10):
        if faults.failed_once:
            break
        with contextlib.suppress(*suppressed):
            llm.step()
    assert faults.failed_once


def disk_copies(llm: LLM) -> set[tuple[int, Key]]:
    """Return the (disk slot, primary key) pairs the offload scheduler holds."""
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    pool = scheduler.tier_pool if scheduler.cascade is None else scheduler.cascade.disk_pool
    keys = ((slot, pool.key(slot)) for slot in range(1, pool.num_blocks))
    return {(slot, key) for slot, key in keys if key is not None}


def restart(
    tmp_path: Path, cascade: bool, token_check: bool = False
) -> tuple[set[tuple[int, Key]], RequestOutput]:
    """Serve PROMPT on a fresh engine; return the (slot, key) pairs it restored and its
    output."""
    config = persistent(tmp_path, cascade, token_check)
    with LLM(MODEL, kv_offload=config, engine=ENGINE) as llm:
        assert llm.offload is not None
        restored = disk_copies(llm)
        assert len(restored) == llm.offload.num_restored_blocks
        (output,) = llm.generate([PROMPT], PARAMS)
    return restored, output


def is_disk_job(job: TransferJob) -> bool:
    return Tier.DISK in (job.src_tier, job.dst_tier)


def test_a_disk_copy_a_failed_load_dropped_is_not_restored(tmp_path: Path) -> None:
    """Disk-only: the prompt's disk copies fail their load (an I/O error: all suspect),
    and the disk fails from then on (no copy is stored again)."""
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as llm:
        faults = held_on_the_tiers_only(llm, Faults)
        faults.fail = is_disk_job
        (output,) = llm.generate([PROMPT], PARAMS)
        assert faults.failed_once
        assert output.num_external_hit_tokens == 0  # recomputed
        assert not disk_copies(llm)  # the scheduler dropped them
    restored, output = restart(tmp_path, cascade=False)
    assert (len(restored), output.num_external_hit_tokens) == (0, 0)


def test_a_failed_disk_load_drops_its_records_at_shutdown(tmp_path: Path) -> None:
    """Disk-only: the engine shuts down right after the prompt's disk load failed, before
    it recomputes (nothing writes the dropped slots again): the shutdown drops them."""
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as llm:
        faults = held_on_the_tiers_only(llm, Faults)
        step_until_its_disk_load_failed(llm, faults)
        assert not disk_copies(llm)
        assert llm.offload is not None
        assert not llm.offload.has_pending_work()
    restored, output = restart(tmp_path, cascade=False)
    assert (len(restored), output.num_external_hit_tokens) == (0, 0)


@pytest.mark.parametrize("then", ["disk", "stores"], ids=["failing-disk", "failing-stores"])
def test_a_demotion_of_a_cpu_copy_a_failed_load_dropped_is_not_restored(
    tmp_path: Path, then: str
) -> None:
    """CPU+disk: the prompt's CPU copies fail their load while their demotion is in flight;
    the demotion completes (its records written) but the scheduler does not register it.
    From then on the disk fails, or GPU stores fail (then no job writes the demotion's
    slots again), so no other copy of the prompt reaches the disk."""
    later = is_disk_job if then == "disk" else (lambda job: job.is_store)
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=True), engine=ENGINE) as llm:
        assert llm.offload is not None
        faults = llm.offload.worker = Faults(llm.offload.worker)  # type: ignore[assignment]
        faults.hold = True
        llm.generate([PROMPT], PARAMS)
        for _ in range(10):  # until the prompt's stores completed and their demotion went out
            if faults.demotions:
                break
            # Each step's poll sees every copy issued before it: 10 idle steps (a few ms)
            # were not always time enough for the copy threads (slow stores, busy cores).
            faults.flush()
            llm.step()
        assert faults.demotions
        evict_gpu(llm)
        faults.fail = lambda job: (job.src_tier is Tier.CPU and job.is_load) or later(job)
        (output,) = llm.generate([PROMPT], PARAMS)
        assert output.num_external_hit_tokens == 0  # recomputed
        llm.drain()
        assert faults.released
        assert not faults.held
        assert not disk_copies(llm)  # the scheduler did not register the demotion
    restored, output = restart(tmp_path, cascade=True)
    assert (len(restored), output.num_external_hit_tokens) == (0, 0)


def test_disk_copies_the_token_check_replaced_are_not_restored(tmp_path: Path) -> None:
    """A run without the check keeps untagged copies; a checking run demotes its tagged
    copies over them and drops them. A restart, with the check or without, restores
    only what that run held."""
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=True), engine=ENGINE) as llm:
        llm.generate([PROMPT], PARAMS)
    config = persistent(tmp_path, cascade=True, token_check=True)
    with LLM(MODEL, kv_offload=config, engine=ENGINE) as llm:
        assert llm.offload is not None
        untagged = disk_copies(llm)
        assert len(untagged) == 5
        (output,) = llm.generate([PROMPT], PARAMS)
        assert output.num_external_hit_tokens == 0  # untagged: never served
        llm.drain()
        held = disk_copies(llm)
    assert held
    assert not held & untagged
    for check in (False, True):  # without the check, a restart indexes untagged ones too
        restored, output = restart(tmp_path, cascade=True, token_check=check)
        assert restored == held
        assert output.num_external_hit_tokens == 20


class RefusingForget(Faults):
    """`Faults`; the first hand-over of dropped slots raises OSError (the engine's, right
    after the report that dropped them); `carried` lists the plans' `forget_slots`."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.refused: tuple[int, ...] | None = None
        self.carried: list[tuple[int, ...]] = []

    def forget_slots(self, slots: Any) -> None:
        if self.refused is None:
            self.refused = tuple(slots)
            raise OSError("no")
        self.worker.forget_slots(slots)

    def submit(self, plan: TransferPlan) -> None:
        if plan.forget_slots:
            self.carried.append(plan.forget_slots)
        super().submit(plan)


def test_records_a_refused_hand_over_was_to_drop_go_with_a_later_plan(tmp_path: Path) -> None:
    """The worker refuses the hand-over of the failed load's records: the next plan
    carries them."""
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as llm:
        faults = held_on_the_tiers_only(llm, RefusingForget)
        faults.fail = is_disk_job
        with pytest.raises(OSError, match="no"):
            llm.generate([PROMPT], PARAMS)
        assert faults.refused is not None
        faults.fail = lambda job: False
        llm.generate([list(range(90, 95))], PARAMS)  # one block: the only one held
        assert faults.carried == [faults.refused]
        llm.drain()  # the one block's store registered (a copy thread runs it)
        held = disk_copies(llm)
    assert len(held) == 1
    restored, output = restart(tmp_path, cascade=False)
    assert (restored, output.num_external_hit_tokens) == (held, 0)


class OlderRelease:
    """Wrap a worker as an older kvtier's: it never drops the records of dropped copies."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def submit(self, plan: TransferPlan) -> None:
        self.worker.submit(dataclasses.replace(plan, forget_slots=()))

    def forget_slots(self, slots: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_a_manifest_holding_untagged_and_tagged_copies_of_a_key_loses_the_untagged(
    tmp_path: Path,
) -> None:
    """A manifest an older release left holds both copies of each block: the untagged one
    (a run without the check) and the tagged one (a checking run since). A checking
    restart indexes the tagged ones only and drops the others' records."""
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=True), engine=ENGINE) as llm:
        llm.generate([PROMPT], PARAMS)
    config = persistent(tmp_path, cascade=True, token_check=True)
    with LLM(MODEL, kv_offload=config, engine=ENGINE) as llm:
        assert llm.offload is not None
        llm.offload.worker = OlderRelease(llm.offload.worker)  # type: ignore[assignment]
        llm.generate([PROMPT], PARAMS)
        llm.drain()
        held = disk_copies(llm)
    assert len(held) == 5
    for _ in range(2):
        restored, output = restart(tmp_path, cascade=True, token_check=True)
        assert restored == held
        assert output.num_external_hit_tokens == 20
