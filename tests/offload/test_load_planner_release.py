"""The load planner's inputs and the order it releases tier blocks in.

Regressions: a lookup pin released, or a queued load dropped by an abort, freed its tier
blocks root first, so the prefix's root was evicted before its tail (SPEC §4); a negative
`num_local_tokens` or `num_external_tokens` was accepted and served the wrong blocks.
"""

from __future__ import annotations

import pytest
from sim import SimEngine, make_request
from test_scenarios_lookup import stored_engine, tier_refs


def _first_request_stored(tier_blocks: int = 8) -> SimEngine:
    """Return an engine whose tier holds the 3 blocks of a 13-token request (GPU evicted)."""
    return stored_engine(num_tokens=13, tier_blocks=tier_blocks)


def _prefix_hit_after_one_eviction(engine: SimEngine) -> int:
    """Store one new block (one eviction), then return the old prefix's tier hit."""
    engine.run(make_request("c", range(100, 105)))
    engine.drain()
    engine.evict_gpu()
    hit = engine.scheduler.lookup(make_request("d", [*range(12), 9]), 0)
    engine.check()
    return hit


# --------------------------------------------------------------------- bad input


def test_on_allocated_refuses_a_negative_number_of_external_tokens() -> None:
    """SPEC §6.3: bad input raises an error naming the value, and leaks no pin.

    `on_allocated(request, table, -4)` passes the hash-block check (-4 % 4 == 0) and the
    `> pin.hit.num_tokens` check, then `pair_blocks` computes ceil(-4 / 4) = -1 blocks and
    slices `hit.block_ids[g][:-1]`: it queues a real load of 2 tier blocks into the
    request's GPU blocks, with a FailedLoad range [0, -4) and -4 hit tokens."""
    engine = _first_request_stored()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    table = engine.gpu.allocate(4)
    with pytest.raises(ValueError, match="-4"):
        engine.scheduler.on_allocated(b, [table], -4)
    assert engine.scheduler.loads.queued == []
    assert tier_refs(engine) == [0] * len(tier_refs(engine))


def test_on_allocated_refuses_external_tokens_that_end_inside_a_hash_block() -> None:
    """SPEC §6.3: `n_external` must be a multiple of the hash block. Accepting 6 of 12
    offered tokens raises an error naming the count, queues nothing and leaks no pin
    (a hit's tier blocks pinned for good are never evicted again)."""
    engine = _first_request_stored()
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    table = engine.gpu.allocate(4)
    with pytest.raises(ValueError, match="num_external_tokens=6 is not a multiple"):
        engine.scheduler.on_allocated(b, [table], 6)
    assert engine.scheduler.loads.queued == []
    assert tier_refs(engine) == [0] * len(tier_refs(engine))


def test_lookup_refuses_a_negative_local_prefix() -> None:
    """SPEC §6.2: bad input raises an error naming the value.

    `lookup(request, -4)` passes the alignment check (-4 % 4 == 0), slices
    `block_hashes[-1:]` — the request's LAST hash — and serves it as if it were the
    block right after the local prefix: it offers 4 tokens and pins the tier block of
    the prompt's third block."""
    engine = _first_request_stored()
    b = make_request("b", [*range(12), 7])
    with pytest.raises(ValueError, match="-4"):
        engine.scheduler.lookup(b, -4)
    with pytest.raises(ValueError, match=r"num_local_tokens must be an int >= 0, got 4\.0"):
        engine.scheduler.lookup(b, 4.0)  # type: ignore[arg-type]
    assert tier_refs(engine) == [0] * len(tier_refs(engine))


# --------------------------------------------------------------------- LRU order


def test_a_released_lookup_pin_keeps_the_prefix_root_younger_than_its_tail() -> None:
    """SPEC §4: hashed blocks return to the free queue in the given order, and callers
    pass a request's blocks tail-first "so prefix tails are evicted before their roots"
    (store and load completions do so). A lookup pin is released root-first instead
    (`LoadPlanner.release_pin` / `on_allocated`'s `self.index.free(pin.pinned)`): a
    request that looks up a stored prefix and then declines it (or simply retries its
    lookup next step, as an engine does for a request it cannot allocate yet) reverses
    the prefix's LRU order. The next eviction then takes the ROOT, so the whole prefix
    stops hitting while its tail blocks keep occupying the tier, unreachable.

    Without the declined lookup the same single eviction leaves an 8-token hit."""
    engine = _first_request_stored(tier_blocks=4)  # 3 usable slots, all holding a's prefix
    b = make_request("b", [*range(12), 7])
    assert engine.scheduler.lookup(b, 0) == 12
    assert engine.scheduler.lookup(b, 0) == 12  # a retry releases the first pin
    assert engine.scheduler.on_allocated(b, [[]], 0) == {}  # then declined
    assert _prefix_hit_after_one_eviction(engine) == 8, "the root went before its tail"


def test_aborting_a_request_before_its_load_is_issued_keeps_the_prefix_root_younger() -> None:
    """The same SPEC §4 order on the abort path: `LoadPlanner.drop_request` frees a queued
    load's tier blocks root-first (`free(load.tier_block_ids)`), where the completion of
    the same load would free them tail-first. After the abort one eviction takes the
    prefix root and the remaining 2 blocks can never hit again."""
    engine = _first_request_stored(tier_blocks=4)
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None  # a load of 12 tokens is queued, not issued
    engine.finish("b")  # aborted before its load was issued
    assert _prefix_hit_after_one_eviction(engine) == 8, "the root went before its tail"


def test_bool_token_counts_are_refused() -> None:
    """`operator.index(False)` is 0: a bool passed as a count is a caller's bug."""
    engine = _first_request_stored()
    b = make_request("b", [*range(12), 7])
    with pytest.raises(ValueError, match="num_local_tokens must be an int >= 0, got False"):
        engine.scheduler.lookup(b, False)
    assert engine.scheduler.lookup(b, 0) == 12
    table = engine.gpu.allocate(4)
    with pytest.raises(ValueError, match="num_external_tokens must be an int >= 0, got True"):
        engine.scheduler.on_allocated(b, [table], True)
    assert tier_refs(engine) == [0] * len(tier_refs(engine))
