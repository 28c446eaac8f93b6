"""The worker role hands every plan's manifest drops to the offload worker, once.

`TransferPlan.forget_slots` (disk slots whose copies the scheduler dropped) and
`end_persistence` must reach `OffloadWorker.submit` before any job of the plan, even on a
plan without jobs; a plan with nothing submits nothing. Regression: only plans with jobs
were submitted, so a plan carrying only `forget_slots` never reached the worker (a
restart could restore the dropped copies' manifest records).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import lone_worker

from kvtier.adapters.vllm.metadata import KVTierMetadata
from kvtier.offload.plan import Tier, TransferJob, TransferPlan


@pytest.fixture
def worker() -> Iterator[Any]:
    with lone_worker() as worker:
        yield worker


def submitted(worker: Any, plan: TransferPlan) -> list[TransferPlan]:
    """Run one step of `plan` through the worker role; return the plans it submitted."""
    offload = worker.connector.worker_side.worker
    plans: list[TransferPlan] = []
    submit = offload.submit

    def record(plan: TransferPlan) -> None:
        plans.append(plan)
        submit(plan)

    offload.submit = record
    connector = worker.connector
    connector.bind_connector_metadata(KVTierMetadata(plan))
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    offload.flush()
    offload.submit = submit
    return plans


def test_a_plan_with_only_dropped_slots_reaches_the_worker(worker: Any) -> None:
    plans = submitted(worker, TransferPlan(step_id=1, forget_slots=(3, 4)))
    assert [(p.jobs, p.forget_slots, p.end_persistence) for p in plans] == [((), (3, 4), False)]
    plans = submitted(worker, TransferPlan(step_id=2, end_persistence=True))
    assert [(p.jobs, p.forget_slots, p.end_persistence) for p in plans] == [((), (), True)]


def test_an_empty_plan_submits_nothing(worker: Any) -> None:
    assert submitted(worker, TransferPlan(step_id=1)) == []


def test_drops_go_once_with_the_first_submit(worker: Any) -> None:
    load = TransferJob(1, Tier.CPU, Tier.GPU, (5,), (9,))
    store = TransferJob(2, Tier.GPU, Tier.CPU, (10,), (6,))
    plan = TransferPlan(1, (load, store), {1: ("r",)}, forget_slots=(7,))
    plans = submitted(worker, plan)
    assert [(p.jobs, p.forget_slots) for p in plans] == [((load,), (7,)), ((store,), ())]
    store = replace(store, event_id=3)
    plans = submitted(worker, TransferPlan(2, (store,), forget_slots=(8,)))
    assert [(p.jobs, p.forget_slots) for p in plans] == [((), (8,)), ((store,), ())]
