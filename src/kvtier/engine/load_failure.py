"""A request whose load failed: how much of it holds valid KV, and its rewind to there
(docs/load_failures.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.engine.request import Request
from kvtier.offload.transfers import FailedLoad

logger = logging.getLogger(__name__)


def rewind(
    layout: KVLayout, request: Request, failed: FailedLoad, suspects: Sequence[int] | None
) -> int:
    """Rewind a request whose load failed to the tokens it keeps (`valid_prefix`); return
    them. With 0, the caller frees its blocks: it recomputes from scratch.

    Safe to repeat (a call cut short by an interrupt): the failed tokens come off its
    external hit count once, with `skip_external` (never set while a request loads: it
    asked the tier), and a repeat keeps what the first call kept (its blocks unchanged,
    or freed: then nothing).
    """
    keep = valid_prefix(layout, request.block_tables, failed, suspects)
    if not request.skip_external:
        if keep > 0:
            logger.warning(
                "load of %s (tokens [%d, %d)) failed: keeping tokens [0, %d), recomputing [%d, %d)",
                failed.request_id,
                failed.start_token,
                failed.end_token,
                keep,
                keep,
                failed.end_token,
            )
        else:  # its local prefix is dropped too: it starts again from token 0
            logger.warning(
                "load of %s (tokens [%d, %d)) failed: recomputing the request from token 0",
                failed.request_id,
                failed.start_token,
                failed.end_token,
            )
        # Off its hit count if that is this load's (`Scheduler._admit`: the admission
        # its first token comes from).
        counted = request.first_token_time is None
        num_lost = failed.end_token - max(keep, failed.start_token) if counted else 0
        # One statement: an interrupt lands before it (redone) or after it (done).
        request.num_external_tokens_total, request.skip_external = (
            request.num_external_tokens_total - num_lost,
            True,  # never ask the tier again (a preemption)
        )
    request.num_computed_tokens = keep  # its blocks from `keep` on are rewritten
    if keep == 0:
        request.needs_full_table = True
    return keep


def valid_prefix(
    layout: KVLayout,
    block_tables: Sequence[Sequence[int]],
    failed: FailedLoad,
    suspects: Sequence[int] | None,
) -> int:
    """Return the tokens of a failed load's request that hold valid KV: up to its first
    block whose copy is suspect (`ReportOutcome.suspect_gpu_blocks`; before it, its local
    prefix and the blocks loaded whole), else 0 (recompute from scratch).

    Only with one full-attention group: a sliding window or a state at a shorter prefix
    needs blocks the load never wrote. A load dropped before it was issued (no suspects),
    or a suspect block outside the request's table, keeps nothing.
    """
    if not suspects or len(layout.groups) != 1:
        return 0
    group = layout.groups[0]
    if group.kind is not GroupKind.FULL_ATTENTION:
        return 0
    table = block_tables[0]
    position = {block_id: pos for pos, block_id in enumerate(table)}
    if any(block_id not in position for block_id in suspects):
        return 0
    keep = min(position[block_id] for block_id in suspects) * group.block_size
    return keep if failed.start_token <= keep < failed.end_token else 0
