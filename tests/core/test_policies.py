"""Eviction and admission policies (kvtier.core.policies): behaviour of each one."""

from __future__ import annotations

import random
import re

import pytest
from policy_helpers import hit, key, store

from kvtier.core.block_pool import BlockPool
from kvtier.core.free_queue import LRUFreeQueue
from kvtier.core.keys import Key
from kvtier.core.policies import (
    ARCPolicy,
    DoorkeeperAdmission,
    DuelingPolicy,
    EvictionPolicy,
    LFUDAPolicy,
    PolicySpec,
    S3FIFOPolicy,
)
from kvtier.core.policies.block_lists import NOT_LISTED, BlockLists
from kvtier.core.policies.sketch import CountMinSketch, Doorkeeper


def cached(pool: BlockPool, keys: list[Key]) -> list[bool]:
    return [pool.cached_block(k) is not None for k in keys]


# ----------------------------------------------------------------- block lists


def test_block_lists_push_pop_unlink() -> None:
    lists = BlockLists(6, 2)
    for b in (1, 2, 3):
        lists.push_tail(0, b)
    lists.push_head(0, 4)
    lists.push_tail(1, 5)
    assert list(lists.iter_list(0)) == [4, 1, 2, 3]
    assert list(lists.iter_list(0, after=1)) == [2, 3]
    assert lists.unlink(2) == 0
    assert lists.where(2) == NOT_LISTED
    assert lists.pop_head(0) == 4
    assert lists.head(1) == 5
    assert (lists.length(0), lists.length(1), lists.total()) == (2, 1, 3)
    lists.check_invariants()
    with pytest.raises(KeyError, match="block 2 is in no list"):
        lists.unlink(2)
    lists.clear()
    assert lists.total() == 0
    assert lists.head(0) is None
    lists.check_invariants()


# ----------------------------------------------------------------- LFU-DA


def test_lfuda_with_max_frequency_one_is_lru() -> None:
    rng = random.Random(7)
    pools = [BlockPool(9), BlockPool(9, free_queue=LFUDAPolicy(9, max_frequency=1))]
    policy = pools[1]._free
    assert isinstance(policy, LFUDAPolicy)
    for _ in range(400):
        k = key(rng.randrange(20))
        if pools[0].cached_block(k) is not None:
            for pool in pools:
                hit(pool, k)
        else:
            ids = [pools[0].allocate(1)[0], pools[1].allocate(1)[0]]
            assert ids[0] == ids[1], "LFU-DA with F=1 evicted a different block than LRU"
            for pool, block_id in zip(pools, ids, strict=True):
                pool.insert_key(k, block_id, 16)
                pool.free([block_id])
            policy.note_key(ids[1], k)
    policy.check_invariants()


def test_lfuda_keeps_a_reused_block_through_a_scan() -> None:
    policy = LFUDAPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    hot = key(0)
    store(pool, policy, hot)
    hit(pool, hot)
    for i in range(1, 4):  # a scan of one-time blocks that just fills the pool
        store(pool, policy, key(i))
    store(pool, policy, key(10))
    assert cached(pool, [hot, key(1)]) == [True, False]
    assert policy.level == 1
    policy.check_invariants()


def test_lfuda_ages_a_formerly_hot_block_out() -> None:
    policy = LFUDAPolicy(4)
    pool = BlockPool(4, free_queue=policy)
    hot = key(0)
    store(pool, policy, hot)
    hit(pool, hot)
    for i in range(1, 12):  # enough evictions to lift L past the hot block's priority
        store(pool, policy, key(i))
    assert not cached(pool, [hot])[0]


# ----------------------------------------------------------------- duel (set dueling)


def access(pool: BlockPool, policy: EvictionPolicy | None, k: Key) -> bool:
    """Hit `k` or store it (noting the key when a policy is given); return True on a hit."""
    block_id = pool.cached_block(k)
    if block_id is not None:
        pool.touch([block_id])
        pool.free([block_id])
        return True
    (block_id,) = pool.allocate(1)
    pool.insert_key(k, block_id, 16)
    if policy is not None:
        policy.note_key(block_id, k)
    pool.free([block_id])
    return False


def test_duel_is_exactly_lru_while_frequency_does_not_pay() -> None:
    rng = random.Random(3)
    policy = DuelingPolicy(9)
    pool, lru = BlockPool(9, free_queue=policy), BlockPool(9)
    recent: list[Key] = []
    for step in range(2000):  # new keys and re-uses of the last three: recency is all
        k = rng.choice(recent[-3:]) if recent and rng.random() < 0.5 else key(1000 + step)
        recent.append(k)
        assert access(pool, policy, k) == access(lru, None, k)
        assert list(pool.iter_free_after(None)) == list(lru.iter_free_after(None)), step
    assert not policy.lfu_order
    policy.check_invariants()


def test_duel_switches_to_lfuda_when_its_shadow_hits_more() -> None:
    policy = DuelingPolicy(9)  # 8 usable blocks
    pool, lru = BlockPool(9, free_queue=policy), BlockPool(9)
    hot = [key(i) for i in range(4)]
    hits = [0, 0]
    for r in range(40):  # 4 hot keys, then 5 fresh ones: LRU always misses the hot keys
        for k in hot + [key(100 + 5 * r + i) for i in range(5)]:
            hits[0] += access(pool, policy, k)
            hits[1] += access(lru, None, k)
    assert policy.lfu_order
    assert hits[1] == 0
    assert hits[0] > 100
    assert all(cached(pool, hot))
    policy.check_invariants()


@pytest.mark.parametrize("rounds", [0, 40])  # LRU order, then LFU-DA order
def test_duel_iterates_in_the_order_it_evicts(rounds: int) -> None:
    policy = DuelingPolicy(9)
    pool = BlockPool(9, free_queue=policy)
    for r in range(rounds):
        for k in [key(i) for i in range(4)] + [key(100 + 5 * r + i) for i in range(5)]:
            access(pool, policy, k)
    assert policy.lfu_order == bool(rounds)
    for i in range(500, 503):
        access(pool, policy, key(i))
    (scratch,) = pool.allocate(1)
    pool.free([scratch])  # unhashed: first
    order = list(pool.iter_free_after(None))
    assert order[0] == scratch
    assert list(pool.iter_free_after(order[2])) == order[3:]
    assert pool.allocate(3) == order[:3]
    policy.check_invariants()


# ----------------------------------------------------------------- ARC


def test_arc_scan_resistance_and_ghost_promotion() -> None:
    policy = ARCPolicy(5)
    pool = BlockPool(5, free_queue=policy)
    hot = key(0)
    store(pool, policy, hot)
    hit(pool, hot)  # -> T2
    for i in range(1, 8):  # a scan through T1
        store(pool, policy, key(i))
    assert cached(pool, [hot])[0], "a block hit once must survive a one-time scan"
    assert policy.target_t1 == 0.0
    store(pool, policy, key(1))  # key(1) was evicted from T1: ghost hit in B1
    assert policy.target_t1 > 0.0
    policy.check_invariants()


def test_arc_iterates_unhashed_then_t1_then_t2() -> None:
    policy = ARCPolicy(6)
    pool = BlockPool(6, free_queue=policy)
    a = store(pool, policy, key(1))
    b = store(pool, policy, key(2))
    hit(pool, key(1))
    order = list(pool.iter_free_after(None))
    assert order[-2:] == [b, a]
    assert list(pool.iter_free_after(order[0])) == order[1:]


def test_arc_a_key_held_by_two_blocks_is_a_ghost_of_one_list_only() -> None:
    """Evicting two copies of one key, from T1 and from T2, leaves it in B2 only.

    The pool keeps a key on several blocks; the key used to end up in both ghost lists.
    """
    policy = ARCPolicy(4)
    pool = BlockPool(4, free_queue=policy)
    first, second = pool.allocate(2)
    pool.insert_key(key(0), first, 16)
    pool.insert_key(key(0), second, 16)
    pool.free([second])
    pool.touch([second])  # `second` is hit: T2
    pool.free([second])
    pool.free([first])  # `first` was never hit: T1
    pool.allocate(3)  # evicts both copies
    policy.check_invariants()
    assert key(0) in policy._b2
    assert key(0) not in policy._b1


# ----------------------------------------------------------------- S3-FIFO


def test_s3fifo_one_hit_wonders_leave_first_and_ghosts_return_to_main() -> None:
    policy = S3FIFOPolicy(11)  # 10 usable blocks: S holds 1
    pool = BlockPool(11, free_queue=policy)
    reused = [key(i) for i in range(5)]
    for k in reused:
        store(pool, policy, k)
        hit(pool, k)  # -> M
    for i in range(100, 120):
        store(pool, policy, key(i))
    assert all(cached(pool, reused)), "blocks hit in S must move to M and stay"
    assert not cached(pool, [key(110)])[0]
    block_id = store(pool, policy, key(110))  # evicted from S, still a ghost: goes to M
    policy.check_invariants()
    assert list(pool.iter_free_after(None))[-1] == block_id


# ----------------------------------------------------------------- admission, sketches


def test_doorkeeper_admits_on_second_sighting_and_forgets() -> None:
    admission = DoorkeeperAdmission(3, window_per_block=1)  # window: 2 insertions
    assert not admission.admit(key(1))
    assert admission.admit(key(1))
    for i in range(10, 15):
        admission.admit(key(i))
    assert not admission.admit(key(1)), "a key older than two windows is forgotten"
    assert admission.num_rejected == 7
    admission.check_invariants()


def test_count_min_sketch_never_underestimates_and_ages() -> None:
    sketch = CountMinSketch(width=64, aging_period=1000)
    rng = random.Random(1)
    truth: dict[Key, int] = {}
    for _ in range(500):
        k = key(rng.randrange(200))
        truth[k] = truth.get(k, 0) + 1
        sketch.add(k)
    for k, count in truth.items():
        assert sketch.estimate(k) >= min(count, 15)
    aging = CountMinSketch(width=64, aging_period=4)
    for _ in range(3):
        aging.add(key(5))
    assert aging.estimate(key(5)) == 3
    aging.add(key(5))  # the 4th addition halves every counter
    assert aging.estimate(key(5)) == 2
    aging.check_invariants()


def test_doorkeeper_filter_is_deterministic() -> None:
    a, b = Doorkeeper(100), Doorkeeper(100)
    for i in range(50):
        a.insert(key(i))
        b.insert(key(i))
    assert [a.contains(key(i)) for i in range(100)] == [b.contains(key(i)) for i in range(100)]
    assert all(a.contains(key(i)) for i in range(50))


# ----------------------------------------------------------------- names


def test_policy_spec_parses_names() -> None:
    assert PolicySpec.parse("LRU").name == "lru"
    assert PolicySpec.parse("lfuda+door") == PolicySpec("lfuda", "door")
    assert PolicySpec.parse("arc+all").name == "arc"
    assert isinstance(PolicySpec.parse("lru").make_eviction(4), LRUFreeQueue)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        PolicySpec.parse("fifo")
    with pytest.raises(ValueError, match="unknown admission policy 'bloom'"):
        PolicySpec.parse("lru+bloom")
    with pytest.raises(ValueError, match="missing admission policy"):
        PolicySpec.parse("lru+")


@pytest.mark.parametrize("name", [3, None, ["lru"]])
def test_policy_spec_names_a_name_that_is_not_a_str(name: object) -> None:
    """A non-str policy name is a TypeError naming it, not an AttributeError."""
    with pytest.raises(TypeError, match=re.escape(f"policy {name!r} is not a name")):
        PolicySpec.parse(name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape(f"eviction policy {name!r} is not a name")):
        PolicySpec(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "lfuda", "duel", "lru+door"])
@pytest.mark.parametrize("num_blocks", [0, 1, -3, 4.0, True])
def test_policies_refuse_a_pool_size_below_two_blocks(name: str, num_blocks: object) -> None:
    """A policy for fewer than 2 blocks or a non-int size is refused, naming the size."""
    spec = PolicySpec.parse(name)
    make = spec.make_eviction if spec.admission == "all" else spec.make_admission
    with pytest.raises(ValueError, match=f"got {num_blocks!r}"):
        make(num_blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "lfuda", "duel"])
def test_every_policy_reuses_unhashed_blocks_first(name: str) -> None:
    policy = PolicySpec.parse(name).make_eviction(6)
    pool = BlockPool(6, free_queue=policy)
    store(pool, policy, key(1))
    (scratch,) = pool.allocate(1)
    pool.free([scratch])  # unhashed: back at the head
    assert pool.allocate(1) == [scratch]
    policy.check_invariants()


def test_discard_keys_counts_no_access_in_lfuda_or_the_duel_shadows() -> None:
    """Dropping a free block's keys (a demoted or failed copy) is not a hit.

    `discard_keys` used to take the block out with `remove`, the touch of a hit: LFU-DA
    counted an access of the dropped key and the duel's shadows replayed one.
    """
    lfuda = LFUDAPolicy(6)
    lfuda_pool = BlockPool(6, free_queue=lfuda)
    block_id = store(lfuda_pool, lfuda, key(1))
    before = lfuda._sketch.estimate(key(1))
    lfuda_pool.discard_keys(block_id)
    assert lfuda._sketch.estimate(key(1)) == before
    duel = DuelingPolicy(6)
    duel_pool = BlockPool(6, free_queue=duel)
    block_id = store(duel_pool, duel, key(1))
    hits = (duel._shadow_lru.hits, duel._shadow_lfu.hits, duel._sampled)
    duel_pool.discard_keys(block_id)
    assert (duel._shadow_lru.hits, duel._shadow_lfu.hits, duel._sampled) == hits
    for pool in (lfuda_pool, duel_pool):
        assert next(pool.iter_free_after(None)) == block_id
        pool.check_invariants()


@pytest.mark.parametrize("name", ["arc", "s3fifo", "lfuda", "duel"])
def test_note_key_twice_is_a_no_op(name: str) -> None:
    """The pool (`insert_key`) and the replay may both report a stored key."""
    once, twice = PolicySpec.parse(name).make_eviction(4), PolicySpec.parse(name).make_eviction(4)
    pools = [BlockPool(4, free_queue=once), BlockPool(4, free_queue=twice)]
    for i in [1, 2, 3, 4, 1, 5, 2, 1, 6, 3]:
        k = key(i)
        for pool, policy, calls in ((pools[0], once, 1), (pools[1], twice, 2)):
            if pool.cached_block(k) is not None:
                hit(pool, k)
                continue
            (block_id,) = pool.allocate(1)
            pool.insert_key(k, block_id, 16)
            for _ in range(calls):
                policy.note_key(block_id, k)
            pool.free([block_id])
    assert list(pools[0].iter_free_after(None)) == list(pools[1].iter_free_after(None))
