"""A step loop with a step cap for tests that look at every step of a `VllmHarness`.

`while harness.is_busy(): harness.step()` never ends when the engine stalls (a load
never reported leaves its request waiting for remote KVs; a store never finished keeps
vLLM stepping for push work): the test then hangs until pytest's timeout instead of
failing. `busy_steps` stops after a step cap and names what is still pending.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def busy_steps(harness: Any, max_steps: int = 1000) -> Iterator[Any]:
    """Yield each step's record (`StepRecord`) while `harness.is_busy()`.

    Each step is `harness.drain_step()`: a step that scheduled nothing waits for the
    workers' copies, so the cap counts steps, not a slow copy thread's time. Still busy
    after `max_steps` steps: AssertionError naming the requests vLLM holds and what else
    keeps it stepping. (The loop's body runs after its step: what the test resets before
    each step, it resets after taking the step's record.)
    """
    for _ in range(max_steps):
        if not harness.is_busy():
            return
        yield harness.drain_step()
    if harness.is_busy():
        raise AssertionError(f"engine still busy after {max_steps} steps: {pending(harness)}")


def pending(harness: Any) -> str:
    """Describe what keeps the engine busy: requests by status, steps in flight, the
    connector's push work (stores)."""
    scheduler = harness.scheduler
    states = {req_id: req.status.name for req_id, req in scheduler.requests.items()}
    connector = scheduler.connector
    push = connector is not None and connector.has_pending_push_work()
    return (
        f"requests {states or 'none'}, finished to clear {sorted(scheduler.finished_req_ids)},"
        f" {len(harness._in_flight)} step(s) awaiting output, pending push work: {push}"
    )
