"""An interrupt after the worker took a plan and ran it: its events count as done.

`OffloadSide.submit` flushes the worker and fails only the events the worker never
started (`_fail_unconfirmed`: those its report lacks). Failing them all would take a
store that completed as failed (the worker's done and the held failure of one event:
"taken as failed"), so the tier would register nothing of what it holds.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_llm_submit_failures import PARAMS, has_stores, new_engine, prompts

from kvtier.offload.plan import TransferPlan


class InterruptAfterRunning:
    """Wrap a worker: the first store plan is taken and run to its end, then an
    interrupt lands before `submit` returns."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.ran: TransferPlan | None = None

    def submit(self, plan: TransferPlan) -> None:
        self.worker.submit(plan)
        if self.ran is None and has_stores(plan):
            self.ran = plan
            self.worker.flush()
            raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_stores_the_worker_ran_before_an_interrupt_count_as_done() -> None:
    llm, arm = new_engine()
    assert llm.offload is not None
    worker = InterruptAfterRunning(llm.offload.worker)
    llm.offload.worker = worker
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(1, 24), PARAMS)
    assert worker.ran is not None
    num_blocks = sum(job.num_blocks for job in worker.ran.jobs if job.is_store)
    arm()
    llm.drain()
    totals = llm.offload.totals
    assert totals.num_failed_stores == 0  # mutant: 6 (every block of the plan)
    assert totals.num_bytes_stored == num_blocks * llm.offload.worker.bytes_per_slot
    llm.shutdown()
