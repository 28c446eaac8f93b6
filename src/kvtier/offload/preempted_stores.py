"""Eager mode: the last stores of a request preempted this step, before its table goes.

The blocks a request computed in the step before its preemption are confirmed only in
the step that preempts it, and the engine frees them with their keys as it resets the
request: without these stores they never reached the tier (a lost store, a later
request's smaller hit).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.pool_block import NULL_BLOCK_ID
from kvtier.offload.block_payload import request_key
from kvtier.offload.store_selection import StoreSelector


def forget_last_step(selector: StoreSelector, request_ids: Iterable[str]) -> None:
    """Forget the last scheduled step of requests whose load failed: the engine counts
    fewer tokens computed once it learns of it (vLLM's recompute policy keeps the
    failed blocks, and those its step computed on them, cached under their keys), so
    where that step ended no longer bounds what is written. Scheduled again, a request
    notes its step afresh (`select_scheduled`). A guard: kvtier's loads are vLLM's async
    loads, whose failure vLLM 0.33 handles while the request waits, before any step is
    noted (`tests/adapters/test_vllm_preempted_failed_load.py` passes without it)."""
    for request_id in request_ids:
        state = selector.tracked.get(request_id)
        if state is not None:
            state.view = None


def select_preempted(selector: StoreSelector, request_id: str) -> None:
    """Select what a request preempted this step had computed, as the step's selection
    would have had it run on.

    From where its last scheduled step ends (`written_end`, kept by `select_scheduled`
    from the tokens confirmed then, so a step in flight before it is not counted; the
    view's counts are reset by now), bounded by `num_tokens - 1`, the tokens whose KV it
    holds (its last step may have ended past draft tokens it then rejected). Under vLLM
    0.33 that is all the bound acts on: with kvtier's `kv_both` role vLLM defers block
    frees and never preempts a request with a step in flight. It stays for an engine
    that does: a decode step in flight has no new token yet, so the bound stops where
    this step's selection would confirm.
    A block must still hold the request's key at its position (the engine may have
    given it to another request since, which lost or changed the key) and be out of
    `unconfirmed` (a same-step victim's, a failed forward's): a group's walk stops at
    the first that does not. Not with the token check (its tags note the blocks' fills
    as scheduled requests take them). Not after a failed load (`forget_last_step`); the
    caller skips a request whose load is still in flight (its outcome unknown).
    """
    state = selector.tracked.get(request_id)
    if state is None or state.view is None or selector.tags is not None:
        return
    request = state.view
    unit = selector.confirm_unit()
    ready_tokens = min(state.written_end, request.num_tokens - 1) // unit * unit
    if ready_tokens < state.next_ready:
        return  # nothing new is confirmed (a decode step's block not yet full)
    layout, gpu_pool, unconfirmed = selector.layout, selector.gpu_pool, selector.unconfirmed
    tables = list(state.block_ids)
    for group_id, block_size in layout.positional_groups:
        table = tables[group_id]
        for pos in range(state.cursors[group_id], min(ready_tokens // block_size, len(table))):
            block_id = table[pos]
            if block_id == NULL_BLOCK_ID:
                continue  # a window's: recovered by key, as in every step
            key = request_key(layout, request, group_id, pos)
            if block_id in unconfirmed or gpu_pool.key(block_id) != key:
                tables[group_id] = table[:pos]
                break
    selector.select_over(request, tables, ready_tokens)
