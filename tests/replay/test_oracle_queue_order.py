"""The offline policies' free queue (`OraclePolicy`) against the `FreeQueue` contract and
its own bypass: which unhashed block is reused next, and the rank `victim_rank` reports
once a queued block has been taken out (its heap entry goes stale)."""

from __future__ import annotations

from kvtier.core.free_queue import LRUFreeQueue
from kvtier.core.keys import make_key
from kvtier.replay.belady import FutureOracle, OraclePolicy, make_oracle_policies


def _key(n: int) -> bytes:
    return make_key(n.to_bytes(8, "little"), 0)


def _belady(num_blocks: int, keys_per_request: list[list[bytes]]) -> OraclePolicy:
    eviction, _ = make_oracle_policies("belady", num_blocks, FutureOracle(keys_per_request))
    return eviction


def test_unhashed_blocks_are_reused_in_the_lru_queues_order() -> None:
    """`clear_and_fill` queues its blocks in order ("in that order", `FreeQueue`), and a
    block pushed back unhashed is reused first, the last pushed first: the order of
    `LRUFreeQueue`, so a pool allocates the same block ids under either queue."""
    oracle_queue = _belady(7, [[]])
    lru_queue = LRUFreeQueue(7)
    orders = []
    for queue in (oracle_queue, lru_queue):
        queue.clear_and_fill(range(1, 5))
        first = [queue.pop_victim(), queue.pop_victim()]
        queue.push_reusable(first[0])
        queue.push_reusable(6)
        orders.append(first + [queue.pop_victim() for _ in range(4)])
    assert orders[0] == orders[1] == [1, 2, 6, 1, 3, 4]


def test_victim_rank_skips_a_block_taken_out_of_the_queue() -> None:
    """Belady's bypass compares a new key with the block `pop_victim` would evict. Key A
    is used again later than key B; once A's block is taken (a hit pins it), the
    would-be victim is B's block, and `victim_rank` must report B's rank, not the
    stale rank of A's heap entry (with it, a block needed sooner than B could be
    refused, or one needed later admitted)."""
    a, b = _key(1), _key(2)
    eviction = _belady(3, [[a, b], [b], [a]])
    eviction.on_request(0)
    for block_id, key in ((1, a), (2, b)):
        eviction.note_key(block_id, key)
        eviction.push_cached(block_id)
    assert eviction.victim_rank() == eviction.rank(a)
    eviction.take(1)
    assert eviction.victim_rank() == eviction.rank(b) < eviction.rank(a)
    assert eviction.pop_victim() == 2
    assert eviction.victim_rank() is None
