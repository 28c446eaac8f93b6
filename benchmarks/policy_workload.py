"""`bench_policies.py`'s workload and driver: requests served by a replay tier, timed.

A tier is `kvtier.replay.tier_store.make_tier`'s: a `BlockPool` with the policy's
`FreeQueue` and its admission policy, as `kvtier replay` and the offload scheduler build
them. A request is served as `TierReplay.step` serves one on a lower tier with no GPU in
front (tail-first release):

- **hit phase** (timed): `pool.lookup` of the prefix, `touch` of the hit blocks;
- **store phase** (timed): `store_missing` — each missing key is offered (`cached_block`,
  the admission policy), and a slot is allocated (evicting the policy's victim once the
  tier is full), keyed (`insert_key`, `note_key`) and freed, last position first;
- **hit release** (timed with the hit phase): the hit blocks are freed, last first.

Keys are 36 bytes, as in a running tier (a 32-byte digest + a 4-byte group id), made
from integer block ids outside the timers. Request `i` has `blocks_per_request` blocks:
with probability `reuse` it starts with the first 1..B ids (uniform) of one of the last
`window` requests (uniform), and the rest are new ids. `window` is capacity / B / 2
requests, so the mix of hits, stores and evictions is the same at every capacity.

`owned_bytes(tier)` is the memory a tier owns: `sys.getsizeof` of every object reachable
from it (pool, policies, the key objects they keep), shared objects (types, modules,
functions) left out. The workload's ids are not reachable from the tier.
"""

from __future__ import annotations

import gc
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import NoReturn

import numpy as np

from kvtier.core.keys import Key, make_key
from kvtier.replay.config import ReleaseOrder, TierConfig
from kvtier.replay.tier_store import TierState, make_tier, store_missing

BLOCK_TOKENS = 16


class Workload:
    """The request stream of one tier; the same seed gives the same stream."""

    def __init__(self, capacity_blocks: int, blocks_per_request: int, reuse: float, seed: int):
        self.blocks_per_request = blocks_per_request
        self.reuse = reuse
        self.window = max(1, capacity_blocks // blocks_per_request // 2)
        self._ring = np.zeros((self.window, blocks_per_request), dtype=np.int64)
        self._count = 0
        self._next_id = 1
        self._rng = random.Random(seed)

    def next_keys(self) -> list[Key]:
        """Return the next request's keys."""
        size = self.blocks_per_request
        rng = self._rng
        ids: list[int] = []
        if self._count and rng.random() < self.reuse:
            back = rng.randint(1, min(self.window, self._count))
            keep = rng.randint(1, size)
            ids = self._ring[(self._count - back) % self.window, :keep].tolist()
        fresh = size - len(ids)
        ids.extend(range(self._next_id, self._next_id + fresh))
        self._next_id += fresh
        self._ring[self._count % self.window] = ids
        self._count += 1
        return [make_key(i.to_bytes(32, "little"), 0) for i in ids]


@dataclass
class Counts:
    """What a tier did over some requests, and the nanoseconds each phase took."""

    requests: int = 0
    refs: int = 0
    hits: int = 0
    offers: int = 0
    stored: int = 0
    refused: int = 0
    evicted: int = 0
    hit_ns: float = 0
    store_ns: float = 0

    def per_op(self) -> dict[str, float]:
        """Return µs per block reference, per hit, per offer and per stored block, and
        evictions per stored block and refusals per offer."""

        def ratio(a: float, b: int) -> float:
            return a / b if b else float("nan")

        return {
            "us_per_ref": ratio((self.hit_ns + self.store_ns) / 1e3, self.refs),
            "us_per_hit": ratio(self.hit_ns / 1e3, self.hits),
            "us_per_offer": ratio(self.store_ns / 1e3, self.offers),
            "us_per_store": ratio(self.store_ns / 1e3, self.stored),
            "evictions_per_store": ratio(self.evicted, self.stored),
            "refused_per_offer": ratio(self.refused, self.offers),
            "hit_ratio": ratio(self.hits, self.refs),
        }


@dataclass
class PolicyTier:
    """One policy's tier at one capacity, and its own request stream."""

    policy: str
    capacity_blocks: int
    tier: TierState
    workload: Workload
    memory: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def build(
        policy: str, capacity_blocks: int, blocks_per_request: int, reuse: float, seed: int
    ) -> PolicyTier:
        """Return a fresh, empty tier of `capacity_blocks` usable blocks."""
        config = TierConfig.named("CPU", capacity_blocks * BLOCK_TOKENS)
        tier = make_tier(config, policy, BLOCK_TOKENS, _no_oracle)
        workload = Workload(capacity_blocks, blocks_per_request, reuse, seed)
        return PolicyTier(policy, capacity_blocks, tier, workload)

    def serve(self, num_requests: int, clock: Callable[[], int], read_ns: float = 0) -> Counts:
        """Serve the next `num_requests` requests; return what happened and its time,
        less `read_ns` (one clock read) per timed interval (two in the hit phase, one in
        the store phase)."""
        tier = self.tier
        pool = tier.pool
        lookup, touch, free = pool.lookup, pool.touch, pool.free
        order = ReleaseOrder.TAIL_FIRST
        counts = Counts(requests=num_requests)
        stored_before, refused_before = tier.stored, tier.rejected
        cached_before = len(pool.index)
        tokens = [BLOCK_TOKENS] * self.workload.blocks_per_request
        hit_ns = store_ns = hits = 0
        for _ in range(num_requests):
            keys = self.workload.next_keys()
            t0 = clock()
            hit_ids = lookup(keys)
            touch(hit_ids)
            placed = list(enumerate(hit_ids))
            t1 = clock()
            # release=False, then the stores and the hits freed as `release_request`
            # frees them tail first (the stores follow the hit prefix).
            stored = store_missing(tier, keys, tokens, placed, order, release=False)
            free([block_id for _, block_id in reversed(stored)])
            t2 = clock()
            free(hit_ids[::-1])
            t3 = clock()
            hit_ns += t1 - t0 + t3 - t2
            store_ns += t2 - t1
            hits += len(hit_ids)
        counts.refs = num_requests * self.workload.blocks_per_request
        counts.hits = hits
        counts.hit_ns = hit_ns - 2 * read_ns * num_requests
        counts.store_ns = store_ns - read_ns * num_requests
        counts.stored = tier.stored - stored_before
        counts.refused = tier.rejected - refused_before
        counts.offers = counts.refs - hits  # a key is offered unless the prefix hit it
        counts.evicted = counts.stored - (len(pool.index) - cached_before)
        return counts

    def fill(self, num_stores: int, chunk: int, on_stored: Callable[[int], object]) -> int:
        """Serve requests (untimed) until `num_stores` more blocks were stored, `chunk`
        requests at a time, calling `on_stored(n)` with each chunk's n stores (up to
        `num_stores` in all); return the requests served."""
        served = 0
        start = self.tier.stored
        reported = 0
        while reported < num_stores:
            self.serve(chunk, _no_clock)
            served += chunk
            done = min(num_stores, self.tier.stored - start)
            on_stored(done - reported)
            reported = done
        return served


SHARED_TYPES = (type, ModuleType, FunctionType, BuiltinFunctionType)


def owned_bytes(*roots: object) -> int:
    """Return `sys.getsizeof` summed over every object reachable from `roots` (each
    counted once), not following types, modules and functions (shared, not owned).

    On 20k-block tiers filled as `bench_policies` fills them this read 7.8-9.4 bytes per
    block less than tracemalloc (allocator granularity), the same for every policy."""
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, SHARED_TYPES):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _no_oracle() -> NoReturn:
    raise AssertionError("bench_policies runs online policies only")


def _no_clock() -> int:
    return 0
