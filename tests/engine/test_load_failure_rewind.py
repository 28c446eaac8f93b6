"""`rewind`: a request whose load failed, back to the tokens it keeps (docs/load_failures.md),
alone and through `QueueRecovery`, which also frees the tables an interrupt left taken.

The request has 8 local tokens (blocks 7, 8) and loaded 16 from the tier into blocks
20..23; the load of tokens [8, 24) failed.
"""

from __future__ import annotations

from collections import deque

from kvtier.core.block_pool import BlockPool
from kvtier.core.hashing import BlockHasher, RequestHasher
from kvtier.core.kv_groups import KVLayout
from kvtier.engine.load_failure import rewind
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.transfers import FailedLoad

SINGLE = KVLayout.single(4, 64)
FAILED = FailedLoad("r", 8, 24)


def loaded_request() -> Request:
    """Return the request as its failed load left it: 24 tokens computed, 16 external."""
    return Request(
        request_id="r",
        prompt_token_ids=list(range(24)),
        params=SamplingParams(max_tokens=1),
        hasher=RequestHasher(BlockHasher(4)),
        num_computed_tokens=24,
        block_tables=[[7, 8, 20, 21, 22, 23]],
        num_external_tokens=16,
        num_external_tokens_total=16,
        needs_full_table=False,
    )


def test_a_kept_prefix_takes_only_the_lost_tokens_off_the_hit_count() -> None:
    request = loaded_request()
    assert rewind(SINGLE, request, FAILED, (22,)) == 16
    assert (request.num_computed_tokens, request.num_external_tokens_total) == (16, 8)
    assert request.skip_external
    assert not request.needs_full_table  # its blocks stand: only new ones are appended


def test_nothing_kept_takes_the_loads_tokens_off_not_the_local_ones() -> None:
    """A load dropped before it was issued (no suspects) keeps nothing: the request
    recomputes from 0, its table sent whole, and loses the 16 tokens the load was to
    bring, not its 8 local ones too (the hit count never goes below 0)."""
    request = loaded_request()
    assert rewind(SINGLE, request, FAILED, None) == 0
    assert (request.num_computed_tokens, request.num_external_tokens_total) == (0, 0)
    assert request.needs_full_table


def test_a_repeated_rewind_takes_the_tokens_off_once() -> None:
    """A rewind cut short by an interrupt is redone: the count drops once."""
    request = loaded_request()
    rewind(SINGLE, request, FAILED, (22,))
    assert rewind(SINGLE, request, FAILED, (22,)) == 16
    assert request.num_external_tokens_total == 8


class Recovery(QueueRecovery):
    """`QueueRecovery` alone over a pool of 16 blocks, without offloading."""

    def __init__(self) -> None:
        self.layout, self.pool, self.offload = SINGLE, BlockPool(16), None
        self.waiting, self.running, self.loading = deque(), [], {}
        self._unfreed, self._aborting = [], {}


def test_an_unqueued_load_is_rewound_losing_only_its_own_tokens() -> None:
    """A request admitted to a load an interrupt kept from being queued (`_unload`):
    it recomputes from 0, its blocks freed, and its hit count loses the 16 tokens of
    that load, not its 8 local ones too."""
    recovery = Recovery()
    request = loaded_request()
    request.block_tables = [recovery.pool.allocate(6)]
    request.status = RequestStatus.WAITING_FOR_LOAD
    recovery._unload(request)
    assert (request.num_computed_tokens, request.num_external_tokens_total) == (0, 0)
    assert (request.status, request.block_tables) == (RequestStatus.WAITING, [[]])
    assert recovery.pool.num_free() == recovery.pool.num_usable_blocks


def test_ending_cut_short_aborts_frees_the_tables_taken() -> None:
    """Tables taken from a request whose frees an interrupt cut short (`_unfreed`, a
    preemption's or an abort's) are freed by `end_aborts`, which `_settle` and
    `LLM.reset_prefix_cache` run before reading the queues and the pool."""
    recovery = Recovery()
    recovery._unfreed = [recovery.pool.allocate(3), recovery.pool.allocate(2)]
    recovery.end_aborts()
    assert not recovery._unfreed
    assert recovery.pool.num_free() == recovery.pool.num_usable_blocks


def test_a_load_after_the_first_token_leaves_the_hit_count() -> None:
    """A request that has its first token (resumed after a preemption) had its hits
    counted by the admission that token came from: a later failed load takes nothing
    off, though the request still never asks the tier again."""
    request = loaded_request()
    request.first_token_time = 1.0
    assert rewind(SINGLE, request, FAILED, (22,)) == 16
    assert (request.num_computed_tokens, request.num_external_tokens_total) == (16, 16)
    assert request.skip_external
