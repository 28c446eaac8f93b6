"""An interrupt after the worker took a plan keeps the records that plan wrote.

A plan drops the records of slots the scheduler let go (`forget_slots`) before its jobs
run; a store of the same step may write those slots again. When an interrupt lands after
the worker took the plan, the engine gives its dropped slots to a later plan, in case
the worker never saw them. Regression: it gave all of them, the slots the plan's store
rewrote included; the store completed and was registered, and the later plan dropped its
records, so a restart lost them (restored 1 of the 5 blocks held at shutdown).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from test_llm_persist_dropped import (
    BLOCK_BYTES,
    ENGINE,
    MODEL,
    PARAMS,
    PROMPT,
    RefusingForget,
    disk_copies,
    evict_gpu,
    held_on_the_tiers_only,
    persistent,
    step_until_its_disk_load_failed,
)

from kvtier.engine.llm import LLM
from kvtier.offload.config import DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan


def small_disk(tmp_path: Path) -> OffloadConfig:
    """A persistent disk-only tier of 5 usable slots: a store reuses the slots dropped."""
    return OffloadConfig(
        cpu_bytes=0,
        disk_bytes=6 * BLOCK_BYTES,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
    )


class InterruptAfterTaking:
    """Wrap a worker: the first plan that drops slots it also writes is taken, then an
    interrupt lands before `submit` returns."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.interrupted: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        self.worker.submit(plan)
        written = {b for j in plan.jobs if j.dst_tier is Tier.DISK for b in j.dst_block_ids}
        if self.interrupted is None and set(plan.forget_slots) & written:
            self.interrupted = plan
            raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_an_interrupt_after_the_worker_took_a_plan_keeps_what_it_wrote(tmp_path: Path) -> None:
    with LLM(MODEL, kv_offload=small_disk(tmp_path), engine=ENGINE) as llm:
        assert llm.offload is not None
        faults = RefusingForget(llm.offload.worker)
        interrupting = InterruptAfterTaking(faults)
        llm.offload.worker = interrupting  # type: ignore[assignment]
        llm.generate([PROMPT], PARAMS)
        llm.drain()
        evict_gpu(llm)
        faults.fail = lambda job: job.src_tier is Tier.DISK  # PROMPT's load fails
        llm.add_request(PROMPT, PARAMS)
        llm.add_request(list(range(50, 71)), PARAMS)  # its stores reuse PROMPT's slots
        for _ in range(20):
            # The hand-over after the failed load is refused (OSError): a plan carries
            # the slots, and is interrupted (KeyboardInterrupt).
            with contextlib.suppress(OSError, KeyboardInterrupt):
                llm.step()
            if interrupting.interrupted is not None:
                break
        assert faults.refused is not None
        assert interrupting.interrupted is not None
        faults.fail = lambda job: False
        llm.drain()
        llm.generate([list(range(90, 95))], PARAMS)  # one more plan
        llm.drain()
        held = disk_copies(llm)
    assert len(held) == 5
    with LLM(MODEL, kv_offload=small_disk(tmp_path), engine=ENGINE) as llm:
        assert disk_copies(llm) == held


def interrupt_a_step_before_its_submit(llm: LLM) -> None:
    """Step `llm` with a Ctrl-C right after its plan was prepared, before its submit."""
    side = llm.offload
    assert side is not None
    submit = side.submit

    def interrupted() -> None:
        side.submit = submit  # type: ignore[method-assign]
        raise KeyboardInterrupt

    side.submit = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.step()


def test_records_an_unsubmitted_plan_was_to_drop_go_at_shutdown(tmp_path: Path) -> None:
    """A failed disk load's records go with the next plan (the worker refused them
    right after the report); an interrupt lands after that plan was prepared and before
    it was submitted, and the engine shuts down (nothing pending: no step follows).
    Regression: the plan held the slots, the shutdown handed over none, and a restart
    restored the 5 dropped blocks."""
    llm = LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE)
    side = llm.offload
    assert side is not None
    faults = held_on_the_tiers_only(llm, RefusingForget)
    # The hand-over after the report is refused (OSError).
    step_until_its_disk_load_failed(llm, faults, OSError)
    assert faults.refused is not None
    assert len(side.scheduler.dropped_slots) == 5
    interrupt_a_step_before_its_submit(llm)
    assert not disk_copies(llm)
    assert not side.has_pending_work()
    llm.shutdown()
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as again:
        assert not disk_copies(again)


def test_records_an_unsubmitted_plan_was_to_drop_go_with_the_next_plan(tmp_path: Path) -> None:
    """As above, but the engine steps on: the next `prepare` fails the unsubmitted plan
    and gives its dropped slots to the plan after it, whose worker drops the records."""
    llm = LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE)
    side = llm.offload
    assert side is not None
    faults = held_on_the_tiers_only(llm, RefusingForget)
    step_until_its_disk_load_failed(llm, faults, OSError)
    assert len(side.scheduler.dropped_slots) == 5
    interrupt_a_step_before_its_submit(llm)
    assert not disk_copies(llm)
    assert not side.scheduler.dropped_slots  # the unsubmitted plan holds them
    llm.generate([list(range(90, 95))], PARAMS)  # the next plans
    llm.drain()
    assert not side.scheduler.dropped_slots  # handed over, none left for the shutdown
    held = disk_copies(llm)  # the new prompt's, stored since
    llm.shutdown()
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as again:
        assert disk_copies(again) == held  # none of the 5 dropped ones


class RefusingPlan(RefusingForget):
    """`RefusingForget`; the first plan that carries dropped slots is refused whole
    (OSError) before the worker took any of it."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.refused_plan: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        if plan.forget_slots and self.refused_plan is None:
            self.refused_plan = plan
            raise OSError("refused")
        super().submit(plan)


def test_records_a_refused_plan_was_to_drop_go_with_a_later_plan(tmp_path: Path) -> None:
    """A failed disk load's records go with the next plan (the hand-over right after the
    report was refused), and the worker refuses that plan before taking any of it: a
    later plan drops them (SPEC §6.8: a failed event registers nothing), and a restart
    restores none of the 5 dropped blocks."""
    llm = LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE)
    side = llm.offload
    assert side is not None
    faults = held_on_the_tiers_only(llm, RefusingPlan)
    step_until_its_disk_load_failed(llm, faults, OSError)
    dropped = faults.refused
    assert dropped is not None
    assert len(dropped) == 5
    with pytest.raises(OSError, match="refused"):
        llm.step()
    assert faults.refused_plan is not None
    assert set(faults.refused_plan.forget_slots) == set(dropped)
    llm.generate([list(range(90, 95))], PARAMS)  # the next plans
    llm.drain()
    assert not side.scheduler.dropped_slots
    assert set(dropped) <= {s for plan in faults.carried for s in plan}
    held = disk_copies(llm)
    llm.shutdown()
    with LLM(MODEL, kv_offload=persistent(tmp_path, cascade=False), engine=ENGINE) as again:
        assert disk_copies(again) == held  # none of the 5 dropped ones
