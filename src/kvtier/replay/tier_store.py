"""One lower tier of a replay: its pool, policies and counters; store selection and release.

Shared by the independent tiers of `TierReplay` and by the CPU → DISK cascade
(`kvtier.replay.cascade`). A hit or a store is a `(position in the request, tier block)`
pair; positions order the release (SPEC §4: last position first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.core.policies import AdmissionPolicy, EvictionPolicy, PolicySpec
from kvtier.replay.belady import OFFLINE_POLICIES, FutureOracle, make_oracle_policies
from kvtier.replay.config import ReleaseOrder, TierConfig

Placed = tuple[int, int]  # (position in the request, block id in the tier's pool)
MakeRoom = Callable[[], None]  # called before each slot is allocated
# Up to this many usable blocks an admission policy is built at the tier's full size
# (`door`: about 130 MB of Bloom filter); beyond, at the most the trace can hold.
ADMISSION_FULL_SIZE_BLOCKS = 1 << 24


@dataclass(slots=True)
class TierState:
    """A lower tier during a replay: its index, policies and what it did so far."""

    config: TierConfig
    pool: BlockPool
    eviction: EvictionPolicy
    admission: AdmissionPolicy
    hit_tokens: int = 0
    hit_blocks: int = 0
    stored: int = 0
    rejected: int = 0
    dropped: int = 0
    demoted: int = 0  # cascade, CPU tier: blocks it copied or moved down to DISK
    promoted: int = 0  # cascade, CPU tier: DISK-served blocks it stored


def make_tier(
    config: TierConfig,
    policy: str,
    block_size: int,
    oracle: Callable[[], FutureOracle],
    max_blocks: int | None = None,
) -> TierState:
    """Return a fresh tier of `config.capacity_tokens // block_size` usable blocks.

    With `max_blocks` (what the trace can ever hold: `TierReplay`) the pool and the
    eviction policy get at most that many usable blocks: a tier that large never evicts
    (every allocation finds an unhashed block, which every policy reuses first), so the
    results are those of the full size. An admission policy sized by the tier (`door`'s
    Bloom filter) keeps the full size up to `ADMISSION_FULL_SIZE_BLOCKS`, so its false
    positives stay those of the configured tier wherever that fits in memory.
    """
    usable = config.capacity_tokens // block_size
    num_blocks = usable + 1 if max_blocks is None else min(usable, max_blocks) + 1
    admission_blocks = num_blocks
    if max_blocks is not None:
        admission_blocks = min(usable, max(max_blocks, ADMISSION_FULL_SIZE_BLOCKS)) + 1
    eviction: EvictionPolicy
    admission: AdmissionPolicy
    if policy in OFFLINE_POLICIES:
        eviction, admission = make_oracle_policies(policy, num_blocks, oracle())
    else:
        spec = PolicySpec.parse(policy)
        eviction = spec.make_eviction(num_blocks)
        admission = spec.make_admission(admission_blocks)
    pool = BlockPool(num_blocks, free_queue=eviction, medium=config.name)
    return TierState(config, pool, eviction, admission)


def release_loads(tier: TierState, hits: Sequence[Placed], order: ReleaseOrder) -> None:
    """Free finished loads before the stores allocate (the scheduler's orders only)."""
    if order is ReleaseOrder.TAIL_FIRST or not hits:
        return
    block_ids = [block_id for _, block_id in hits]
    tier.pool.free(block_ids if order is ReleaseOrder.SCHEDULER else block_ids[::-1])


def release_request(
    tier: TierState, hits: Sequence[Placed], stored: Sequence[Placed], order: ReleaseOrder
) -> None:
    """Free the request's blocks in `tier` once its stores are registered.

    `tail_first`: hits and stores together, last position first; otherwise the stores
    only (the loads were freed by `release_loads`), in position order or reversed.
    """
    pool = tier.pool
    if order is not ReleaseOrder.TAIL_FIRST:
        new = [block_id for _, block_id in stored]
        pool.free(new if order is ReleaseOrder.SCHEDULER else new[::-1])
        return
    placed = sorted([*hits, *stored], reverse=True)
    pool.free([block_id for _, block_id in placed])


def store_missing(
    tier: TierState,
    keys: Sequence[Key],
    tokens: Sequence[int],
    hits: Sequence[Placed],
    order: ReleaseOrder,
    positions: Sequence[int] | None = None,
    use_admission: bool = True,
    make_room: MakeRoom | None = None,
    release: bool = True,
) -> list[Placed]:
    """Store the request's blocks the tier lacks; release the request's tier blocks.

    As `StoreSelector.select_request` does: `positions` (default every position) in
    order; the candidates are the keys missing when the selection starts (a key evicted
    by this request's own stores is not re-stored); ask the admission policy (unless
    `use_admission` is False); stop when no slot is free (every one pinned). Before each
    slot is allocated `make_room()` may empty its victim (write-back demotion). With
    `release` False the caller frees the request's blocks (`release_request`).
    Returns the stored `(position, block)` pairs.
    """
    release_loads(tier, hits, order)
    pool = tier.pool
    cached_block = pool.cached_block
    admit = tier.admission.admit
    offered = range(len(keys)) if positions is None else positions
    candidates = [j for j in offered if cached_block(keys[j]) is None]
    allocate = pool.allocate
    stored: list[Placed] = []
    for k, j in enumerate(candidates):
        if use_admission and not admit(keys[j]):  # may read the pool (offline policies)
            tier.rejected += 1
            continue
        if not pool.can_allocate(1):
            tier.dropped += len(candidates) - k
            break
        if make_room is not None:
            make_room()
        stored.append((j, allocate(1)[0]))
    note_key = tier.eviction.note_key
    for j, block_id in stored:
        pool.insert_key(keys[j], block_id, tokens[j])
        note_key(block_id, keys[j])  # the BlockPool hook already did; idempotent
    tier.stored += len(stored)
    if release:
        release_request(tier, hits, stored, order)
    return stored
