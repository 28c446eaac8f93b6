"""The tiny reference model the replay tests compare against: OrderedDict LRU tiers
(least recently used first) on hash ids, and random chained-prefix traces."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from kvtier.replay.trace import TraceRecord

BLOCK = 4  # tokens per block


@dataclass
class RefTier:
    capacity: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    hit_tokens: int = 0
    hit_blocks: int = 0
    stored: int = 0
    dropped: int = 0


def store(
    tier: RefTier,
    ids: Sequence[int],
    positions: Sequence[int],
    pinned: set[int],
    on_evict: Callable[[int], None] | None = None,
) -> list[int]:
    """Store the ids at `positions` the tier lacks, in order; evict its LRU unpinned key."""
    stored: list[int] = []
    todo = [j for j in positions if ids[j] not in tier.cache]
    for k, j in enumerate(todo):
        if len(tier.cache) >= tier.capacity:
            victim = next((h for h in tier.cache if h not in pinned), None)
            if victim is None:
                tier.dropped += len(todo) - k
                break
            if on_evict is not None:
                on_evict(victim)
            del tier.cache[victim]
        tier.cache[ids[j]] = None
        pinned.add(ids[j])
        stored.append(j)
    tier.stored += len(stored)
    return stored


def refresh(
    cache: OrderedDict[int, None],
    ids: Sequence[int],
    positions: Sequence[int],
    root_last: bool = True,
) -> None:
    """Free the blocks at `positions` to the MRU end: last position first (the root ends
    most recent), or (`root_last` False) in position order."""
    for j in sorted(positions, reverse=root_last):
        cache.move_to_end(ids[j])


def serve_on_gpu(gpu: RefTier, ids: Sequence[int], tokens: Sequence[int]) -> int:
    """Return the GPU tier's prefix hit in blocks; compute the rest, refresh all."""
    end = 0
    while end < len(ids) and ids[end] in gpu.cache:
        end += 1
    gpu.hit_tokens += sum(tokens[:end])
    store(gpu, ids, range(len(ids)), set(ids[:end]))
    refresh(gpu.cache, ids, range(len(ids)))
    return end


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRecord]:
    """Chained prefixes: each request extends a prefix of an earlier one (or none)."""
    records: list[TraceRecord] = []
    sizes: dict[int, int] = {}  # id -> tokens
    next_id = 0
    for i in range(draw(st.integers(1, 14))):
        prefix: list[int] = []
        if records and draw(st.booleans()):
            base = records[draw(st.integers(0, len(records) - 1))].hash_ids
            prefix = list(base[: draw(st.integers(0, len(base)))])
        new = draw(st.integers(0, 4))
        if new and prefix and sizes[prefix[-1]] < BLOCK:
            prefix.pop()  # a partial block ends its prompt
        ids = prefix + list(range(next_id, next_id + new))
        for j in range(new):
            sizes[next_id + j] = BLOCK if j < new - 1 else draw(st.integers(1, BLOCK))
        next_id += new
        length = sum(sizes[h] for h in ids)
        records.append(TraceRecord(i, length, draw(st.integers(0, 9)), tuple(ids)))
    return records
