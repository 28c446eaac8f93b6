"""Why a rank that skips a plan loses no disk-slot drops (test_vllm_skipped_plan.py).

A plan's `forget_slots` and `end_persistence` are manifest work for a persistent disk
tier (`disk_persist`): they drop records a restart would otherwise restore. The vLLM
connector refuses `disk_persist` (test_vllm_config.py), so its scheduler role notes no
dropped slot (`DroppedSlots` inactive) and its workers' disk tiers keep no manifest: no
plan carries such work, even where the scheduler drops disk copies (a bad slot's,
failed stores') or resets the tier. A rank that never binds a plan has no record to
drop; the plan's disk slots themselves are the scheduler's, freed once every rank
reported the plan's jobs (the skipping rank fails them at its next bind).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import SLOT_BYTES, check_quiescent, kvtier_harness, offload_worker, scheduler_side
from test_vllm_bad_disk_slot import record_recomputed, serve_again, stored_and_evicted
from test_vllm_partial_load_failure import CorruptSlot
from test_vllm_skipped_plan import abort_all_on_fault, apply_outputs, run_on

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.offload.plan import Tier


@pytest.mark.parametrize("noting", [False, True], ids=["as-configured", "noting-drops"])
def test_no_plan_carries_manifest_work_where_disk_copies_are_dropped(
    tmp_path: Path, noting: bool
) -> None:
    """`noting`: the scheduler role notes dropped slots as for a persistent tier (a
    check that the run drops disk copies: its plans then name them)."""
    extra: dict[str, Any] = {"cpu_bytes": 0, "disk_bytes": 256 * SLOT_BYTES}
    extra.update(disk_path=str(tmp_path), disk_io_mode="page_cache")
    harness = kvtier_harness(extra=extra, num_ranks=2)
    side = scheduler_side(harness)
    assert not side.offload.dropped_slots.active
    side.offload.dropped_slots.active = noting
    for rank in range(2):
        disk = offload_worker(harness, rank)._held.disk_tier
        assert disk is not None
        assert not disk.persistent
    plans: list[KVTierMetadata] = []
    build = harness.scheduler.connector.build_connector_meta

    def recording(scheduler_output: Any) -> Any:
        metadata = build(scheduler_output)
        plans.append(metadata)
        return metadata

    harness.scheduler.connector.build_connector_meta = recording  # type: ignore[method-assign]
    prompts = stored_and_evicted(harness)
    CorruptSlot(offload_worker(harness, rank=0), 0, byte=0)
    recomputed = record_recomputed(harness)
    prompts = serve_again(harness, prompts)  # the bad slot's copies are dropped
    assert len(recomputed) == 1
    harness.add_request("x", list(range(5000, 5065)), max_tokens=50)
    harness.step()
    skipped = harness.scheduler.schedule()  # rank 0 raises before binding it
    outputs = run_on(harness, range(1, 2), skipped)
    abort_all_on_fault(harness)  # the plan's stores fail: their slots are dropped
    apply_outputs(harness, outputs)
    serve_again(harness, prompts)
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)  # the tier too
    serve_again(harness, prompts)
    assert any(job.dst_tier is Tier.DISK for m in plans for job in m.plan.jobs)
    forgotten = [m.plan.forget_slots for m in plans if m.plan.forget_slots]
    assert bool(forgotten) == noting
    assert not any(m.plan.end_persistence for m in plans)
    check_quiescent(harness)
