"""`TransferPlan.forget_slots`: disk copies the scheduler dropped lose their manifest records."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_worker_persist import config, first_run, new_kv, rec, store
from transfer_helpers import make_worker

from kvtier.offload.plan import TransferPlan

pytestmark = pytest.mark.timeout(60)


def test_forgotten_slots_are_not_recovered_and_a_rewrite_in_the_same_plan_is(
    tmp_path: Path,
) -> None:
    """The records go before the plan's jobs run: a slot the same plan writes again keeps
    its new record. `forget_slots` (no plan, e.g. at shutdown) drops them at once."""
    first_run(tmp_path)  # records of slots 3, 5, 7, 9
    with make_worker(config(tmp_path), new_kv(seed=2)) as worker:
        plan = TransferPlan(step_id=1, jobs=(store(1, [1], [7]),), forget_slots=(3, 7))
        worker.submit(plan)
        worker.flush()
        assert dict(worker.poll().done) == {1: 1}
        assert worker.recovered_slots() == [(5, rec(5)), (9, rec(9))]
        worker.forget_slots([9])
        assert worker.recovered_slots() == [(5, rec(5))]
        with pytest.raises(ValueError, match="outside"):
            worker.forget_slots([16])
    with make_worker(config(tmp_path), new_kv(seed=3)) as worker:
        assert worker.recovered_slots() == [(5, rec(5)), (7, rec(7))]


def test_a_non_persistent_tier_ignores_forgotten_slots(tmp_path: Path) -> None:
    with make_worker(config(tmp_path, disk_persist=False), new_kv(seed=2)) as worker:
        worker.submit(TransferPlan(step_id=1, forget_slots=(3,)))
        worker.forget_slots([4])
        assert worker.recovered_slots() == []
