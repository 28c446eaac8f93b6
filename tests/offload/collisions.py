"""Forged hash collisions for the token check's tests: requests whose block hashes are
another request's, and a sharer that stores a preempted request's blocks under them."""

from __future__ import annotations

from sim import Admission, SimEngine, SimRequest

from kvtier.core.hashing import BlockHasher, RequestHasher


def colliding(request_id: str, tokens: list[int], hashed_as: list[int]) -> SimRequest:
    """Return a request of `tokens` whose block hashes are those of `hashed_as` (a forged
    hash collision: same hashes, other tokens)."""
    assert len(tokens) == len(hashed_as)
    hasher = RequestHasher(BlockHasher(4))
    hasher.extend(hashed_as)
    return SimRequest(request_id, list(tokens), len(tokens), hasher)


def stored_by_a_sharer(engine: SimEngine, b_tokens: list[int], a_tokens: list[int]) -> Admission:
    """Preempt "d" before a step notes its blocks; "b" (tokens `b_tokens`, hashed as
    `a_tokens`) shares D's blocks by key, computes one step and finishes, storing them;
    "d" is then aborted while waiting and the GPU cache evicted. Return b's admission."""
    d = engine.preempt("d")
    admission = engine.admit(colliding("b", b_tokens, a_tokens))
    engine.schedule("b")
    engine.step()
    engine.finish("b")
    engine.drain()
    engine.finish("d", d)
    engine.evict_gpu()
    return admission
