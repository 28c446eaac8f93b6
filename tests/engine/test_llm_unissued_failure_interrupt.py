"""A Ctrl-C in `LoadPlanner._fail_unissued` after it queued the failure of a load that
could not be queued, before it marked the load `queued_for`.

The engine's `_settle` then sees a load never queued and rewinds the request to
recompute (`_unload`), as the failure, applied later, would have; the failure reported
afterwards finds it no longer loading and is ignored, and the request it puts back in
`recompute_next` (asked by nobody: the request recomputes, `skip_external`) leaves it when
the request finishes. Coverage: every request serves the logits of an engine without
offloading, and the drained engine holds no block and no request in `recompute_next`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_llm_admit_interrupts import expected_logits
from test_llm_poll_interrupts import interrupt_once, loaded_engine
from test_llm_submit_failures import MAX_STEPS, PARAMS, assert_consistent_and_drained, turns

from kvtier.engine.request import RequestStatus


@pytest.mark.parametrize("interrupted_too", [False, True], ids=["failed", "interrupted"])
def test_an_interrupt_between_an_unissued_failure_and_queued_for(interrupted_too: bool) -> None:
    expected = expected_logits()
    llm, arm = loaded_engine()
    assert llm.offload is not None
    llm.engine_config = dataclasses.replace(llm.engine_config, keep_logits=True)
    loads = llm.offload.scheduler.loads
    accepted_hit, fail_unissued = loads._accepted_hit, loads.book.fail_unissued
    refused: list[bool] = []
    interrupted: list[bool] = []

    def accepting(*args: Any) -> Any:  # the first accepted hit is gone from the tier
        if not refused:
            refused.append(True)
            return None
        return accepted_hit(*args)

    def failing(failure: Any) -> None:
        fail_unissued(failure)
        if interrupted_too:
            interrupt_once(interrupted, "Ctrl-C after TransferBook.fail_unissued")

    unload = llm.scheduler._unload
    unloaded: list[str] = []

    def unloading(request: Any) -> None:
        unloaded.append(request.request_id)
        unload(request)

    llm.scheduler._unload = unloading  # type: ignore[method-assign]
    loads._accepted_hit = accepting  # type: ignore[method-assign]
    loads.book.fail_unissued = failing  # type: ignore[method-assign]
    _, second, _ = turns()
    arm()
    requests = [llm.add_request(prompt, PARAMS) for prompt in second]
    for _ in range(MAX_STEPS):
        if not llm.scheduler.has_unfinished():
            break
        try:
            llm.step()
        except KeyboardInterrupt:
            continue
    assert refused == [True]
    assert interrupted == ([True] if interrupted_too else [])
    assert len(unloaded) == (1 if interrupted_too else 0), f"rewound by _settle: {unloaded}"
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    for request, logits in zip(requests, expected, strict=True):
        diff = float((torch.stack(request.kept_logits) - logits).abs().max())
        assert diff < 1e-4, f"{request.request_id}: logits off by {diff}"
    assert_consistent_and_drained(llm, arm)
    assert not loads.recompute_next, f"left to recompute: {loads.recompute_next}"
    llm.shutdown()
