"""Interrupts (Ctrl-C) inside one step of applying a completed load: right after it
released the load's tier pins, or its GPU pins.

Regression: the step counted as applied only once all of it ran, so the next poll ran
it again and released the pins a second time: a `PoolError` ("freed more often than
referenced") at every later poll, or, where another holder still referenced a block,
that holder's reference dropped (the block reused under it: wrong KV). A step that
releases pins now counts as applied before it runs (cut short, it leaks, never frees
twice), and the load's pending count is taken down once.

Also at every line of `TransferBook._forget` (dropping an applied event): cut short
after the event left the book but before its share of the aggregates did, it was never
taken off again ("outstanding load events"; a store event's count kept `drain` waiting).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_llm_poll_interrupts import (
    interrupt_once,
    interrupted_at_every_line,
    loaded_engine,
    served_after_an_interrupt,
)

from kvtier.offload.plan import Tier
from kvtier.offload.transfers import TransferBook


@pytest.mark.parametrize("stepped", [False, True], ids=["generate", "step"])
@pytest.mark.parametrize("pins", ["tier", "gpu"])
def test_an_interrupt_right_after_a_load_released_its_pins(pins: str, stepped: bool) -> None:
    llm, arm = loaded_engine()
    assert llm.offload is not None
    scheduler = llm.offload.scheduler
    book, completion = scheduler._book, scheduler._completion
    assert completion.selector is not None
    tier_pool = completion._index.pools[Tier.CPU]
    pool: Any = tier_pool if pins == "tier" else completion.selector.gpu_pool
    complete, free = book.complete, pool.free
    released: list[list[int]] = []  # the pins of the loads just completed, tail first
    interrupted: list[bool] = []

    def completing(report: Any) -> Any:
        completed = complete(report)
        for load in (load for transfer in completed for load in transfer.loads):
            ids = load.tier_block_ids if pins == "tier" else load.gpu_block_ids
            released.append(ids[::-1])
        return completed

    def freeing(block_ids: Any) -> None:
        free(block_ids)
        if list(block_ids) in released:
            interrupt_once(interrupted, f"Ctrl-C after a load released its {pins} pins")

    book.complete = completing  # type: ignore[method-assign]
    pool.free = freeing
    served_after_an_interrupt(llm, arm, interrupted, stepped=stepped)


def test_an_interrupt_at_any_line_of_dropping_an_applied_event() -> None:
    interrupted_at_every_line((TransferBook._forget.__code__,), fewest_lines=3)
