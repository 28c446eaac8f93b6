"""What the flush, deduplication and LRU scenarios ask of a `SimEngine` (SPEC §9)."""

from __future__ import annotations

from sim import SimEngine, SimRequest, block_key

from kvtier.core.keys import Key


def keys_of(
    engine: SimEngine, request: SimRequest, num_blocks: int, group_id: int = 0
) -> list[Key]:
    return [block_key(engine.layout, request, group_id, pos) for pos in range(num_blocks)]


def in_tier(engine: SimEngine, keys: list[Key]) -> list[bool]:
    return [engine.scheduler.tier_pool.cached_block(k) is not None for k in keys]


def num_cached_slots(engine: SimEngine) -> int:
    tier = engine.scheduler.tier_pool
    return sum(tier.is_cached(b) for b in range(1, tier.num_blocks))


def computed(engine: SimEngine, request: SimRequest, accept: int | None = None) -> SimRequest:
    """Admit a request and compute its whole prompt in one step (it stays running)."""
    assert engine.admit(request, accept) is not None
    engine.schedule(request.request_id)
    engine.step()
    return request
