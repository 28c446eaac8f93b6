"""Lookups and loads of the offload scheduler (SPEC §6.2, §6.3).

`LoadPlanner` finds the longest hit across the lower tiers, pins it until the engine
allocates (or looks up again), pairs the accepted tier blocks with the request's GPU
blocks and queues one `LoadItem` per tier the hit spans, until `build_plan` issues them.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import Key, key_block_hash
from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.core.longest_hit import CachedBlockFn, HitGranularity, LongestHit, find_longest_hit
from kvtier.offload.load_pairing import pair_blocks
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import GpuPoolView, RequestView
from kvtier.offload.recompute_gate import RecomputeGate
from kvtier.offload.request_tags import RequestTags
from kvtier.offload.tier_index import TierIndex
from kvtier.offload.transfers import FailedLoad, LoadItem, LoadProgress, TransferBook

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LookupPin:
    """A lookup's hit, pinned until `on_allocated` consumes or releases it."""

    num_local_tokens: int
    hit: LongestHit
    pinned: list[int]  # ids in the tier index's shared space, tail first (SPEC §4)


class LoadPlanner(RecomputeGate):
    """Lookup pins and queued loads; `hit_tokens` counts served hit tokens per tier.

    A load's tokens count in `hit_tokens` once it completed on every tier it reads from
    (`TransferCompletion` adds them); a load that fails, is dropped, or whose request
    finished before it completed, counts nothing.
    What lookups of requests whose load failed answer: `RecomputeGate`, a mixin.

    `eagle_proof` (an EAGLE-style drafter): a hit needs the unit after it cached in
    attention groups too (`core.longest_hit`); vLLM's own hits for such a drafter end there.

    With `tags` (the token check on), a tier block counts as a hit only where its token
    tag is the looking-up request's own; `num_tag_mismatches` counts tier blocks whose
    key matched but whose tag did not (a hash collision, or a corrupted tag), once per
    request and block however often the request is looked up.
    """

    def __init__(
        self,
        layout: KVLayout,
        index: TierIndex,
        granularity: HitGranularity,
        book: TransferBook,
        tags: RequestTags | None = None,
        recompute_ahead: bool = False,
        eagle_proof: bool = False,
    ) -> None:
        self.layout = layout
        self.eagle_proof = eagle_proof
        self.recompute_ahead = recompute_ahead
        self.index = index
        self.granularity = granularity
        self.book = book
        self.tags = tags
        self.num_tag_mismatches = 0
        # Per live request, the (tier block, key) mismatches counted: vLLM looks a waiting
        # request up again every step, and one collision is counted (and logged) once.
        self._mismatches_seen: dict[str, set[tuple[int, Key]]] = {}
        self.gpu_pool: GpuPoolView | None = None
        self.pins: dict[str, LookupPin] = {}
        self.queued: list[LoadItem] = []
        self.hit_tokens: Counter[str] = Counter()
        self.recompute_next: set[str] = set()
        self.recompute_unasked: set[str] = set()  # not looked up since their load failed
        self._recompute_asked: set[str] = set()  # of `recompute_next`, in this pass
        self.allocated: set[str] = set()
        # Requests looked up and not allocated (nor finished) since: a reset between the
        # two leaves them the KV their lookup found, which predates it (`TierReset`).
        self.looked_up: set[str] = set()
        # Per request, the block tables `on_allocated` last queued a load (or its failure)
        # into (`holds_load`).
        self.queued_for: dict[str, Sequence[Sequence[int]]] = {}
        self._warned_misaligned = False
        # The first blocks of a hit serve any shorter prefix of it (SPEC §6.3).
        self._prefix_only = all(
            layout.groups[g].kind is GroupKind.FULL_ATTENTION for g in layout.cacheable_group_ids
        )

    def lookup(
        self, request: RequestView, num_local_tokens: int, max_tokens: int | None = None
    ) -> int:
        """Return how many tokens past the local prefix the tiers can serve, and pin them.

        `max_tokens` (None: no cap) caps the hit: the longest servable hit of at most
        that many tokens, which in a hybrid layout is not the longest hit cut short.
        """
        # Checks, pin release, tier lookup inlined: a lookup runs cold, ~0.5 µs a call.
        if type(num_local_tokens) is not int or num_local_tokens < 0:
            _check_count("num_local_tokens", num_local_tokens)
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens)
        self.looked_up.add(request.request_id)
        pin = self.pins.pop(request.request_id, None)
        if pin is not None:
            self.index.free(pin.pinned)
        if self.tags is not None:
            self.tags.note_lookup(request.request_id, num_local_tokens)
        if request.request_id in self.recompute_next:
            self._recompute_asked.add(request.request_id)
            return 0
        if request.skip_prefix_cache:
            return 0
        if num_local_tokens % self.layout.scheduler_block_size:
            if not self._warned_misaligned:
                logger.warning(
                    "local prefix of %d tokens is not a multiple of the scheduler block (%d): "
                    "no external hit (warned once)",
                    num_local_tokens,
                    self.layout.scheduler_block_size,
                )
                self._warned_misaligned = True
            return 0
        hashes = request.block_hashes[num_local_tokens // self.layout.hash_block_size :]
        cap = request.num_tokens - 1 - num_local_tokens  # the last token is recomputed
        max_tokens = cap if max_tokens is None else min(cap, max_tokens)
        if not hashes or max_tokens <= 0:
            return 0
        cached = self.index.cached_block if self.tags is None else self._cached_fn(request)
        hit = find_longest_hit(
            self.layout, hashes, max_tokens, cached, self.granularity, self.eagle_proof
        )
        if hit.num_tokens == 0:
            return 0
        # Tail first: a released pin frees them in this order, so that the prefix's
        # tail is evicted before its root, as after a load (SPEC §4).
        pinned = [b for ids in hit.block_ids for b in ids if b != NULL_BLOCK_ID][::-1]
        if not pinned:  # windows of one token need no block: a load would copy none
            return 0
        self.index.touch(pinned)
        self.pins[request.request_id] = LookupPin(num_local_tokens, hit, pinned)
        return hit.num_tokens

    def on_allocated(
        self,
        request: RequestView,
        block_ids_per_group: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> dict[Tier, int]:
        """Queue the load of the accepted tokens; a load that cannot be queued fails.

        Returns the tokens each tier serves (empty when nothing is loaded).
        """
        assert self.gpu_pool is not None, "no GPU pool bound"
        request_id = request.request_id
        self.allocated.add(request_id)
        self.looked_up.discard(request_id)
        self.recompute_next.discard(request_id)
        self.recompute_unasked.discard(request_id)
        # The pin stays in `pins` until the load is queued (or failed): an interrupt
        # before that leaves it for the next lookup (or `drop_request`) to release.
        pin = self.pins.get(request_id)
        try:
            if type(num_external_tokens) is not int or num_external_tokens < 0:
                _check_count("num_external_tokens", num_external_tokens)
        except ValueError:
            self.release_pin(request_id)  # bad input must not leak the pin
            raise
        if num_external_tokens == 0:
            if pin is not None:  # the engine may decline a hit (e.g. vLLM's hybrid paths)
                logger.debug("request %s accepted 0 of its tier hit", request_id)
                self.release_pin(request_id)
            return {}
        start = pin.num_local_tokens if pin is not None else request.num_computed_tokens
        end = start + num_external_tokens
        if pin is None or num_external_tokens > pin.hit.num_tokens:
            logger.warning(
                "request %s: %d external tokens without a matching lookup pin; not loading",
                request.request_id,
                num_external_tokens,
            )
            self.release_pin(request_id)
            self._fail_unissued(request_id, block_ids_per_group, FailedLoad(request_id, start, end))
            return {}
        if num_external_tokens % self.layout.hash_block_size:
            self.release_pin(request_id)
            raise ValueError(
                f"num_external_tokens={num_external_tokens} is not a multiple of the hash "
                f"block ({self.layout.hash_block_size})"
            )
        hit = self._accepted_hit(request, pin, num_external_tokens)
        if hit is None:
            logger.warning(
                "request %s: no tier hit of exactly the %d accepted tokens; not loading",
                request.request_id,
                num_external_tokens,
            )
            self.release_pin(request_id)
            self._fail_unissued(request_id, block_ids_per_group, FailedLoad(request_id, start, end))
            return {}
        try:
            tier_ids, gpu_ids = pair_blocks(
                self.layout, pin.num_local_tokens, hit, block_ids_per_group, num_external_tokens
            )
        except ValueError:
            self.release_pin(request_id)  # the engine's error must not leak the pin
            raise
        parts = self.index.split_pairs(tier_ids, gpu_ids)
        if self._lost_keys(parts):
            logger.warning(
                "request %s: a tier block of its hit lost its keys since the lookup (a "
                "failed load named it bad, or a newer copy replaced it); not loading",
                request_id,
            )
            self.release_pin(request_id)
            self._fail_unissued(request_id, block_ids_per_group, FailedLoad(request_id, start, end))
            return {}
        # Tokens per tier in proportion to its blocks (exact for one KV group).
        shares = [num_external_tokens * len(ids) // len(tier_ids) for _, ids, _ in parts]
        shares[0] += num_external_tokens - sum(shares)
        tier_tokens = {tier.value: share for (tier, _, _), share in zip(parts, shares, strict=True)}
        progress = LoadProgress(request_id, start, end, len(parts), False, tier_tokens)
        items = [LoadItem(tier, ids, gpus, progress) for tier, ids, gpus in parts]
        self._queue(request_id, block_ids_per_group, items, tier_ids, gpu_ids)
        self.release_pin(request_id)
        return {tier: share for (tier, _, _), share in zip(parts, shares, strict=True)}

    def _queue(
        self,
        request_id: str,
        block_ids_per_group: Sequence[Sequence[int]],
        items: list[LoadItem],
        tier_ids: list[int],
        gpu_ids: list[int],
    ) -> None:
        """Pin a load's blocks, then queue all its parts and mark it `queued_for` at once:
        an interrupt before that statement leaves no part of it queued (a load queued in
        part would never finish)."""
        assert self.gpu_pool is not None, "no GPU pool bound"
        self.index.touch(tier_ids)
        self.gpu_pool.touch(gpu_ids)
        self.queued, self.queued_for[request_id] = [*self.queued, *items], block_ids_per_group

    def _fail_unissued(
        self, request_id: str, block_ids_per_group: Sequence[Sequence[int]], failed: FailedLoad
    ) -> None:
        """Queue the failure of a load that cannot be queued, then mark it `queued_for`."""
        self.book.fail_unissued(failed)
        self.queued_for[request_id] = block_ids_per_group

    def holds_load(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]]) -> bool:
        """Return True when `on_allocated` queued the load into these very tables (the
        engine's list, by identity) or its failure: its outcome is on its way. False
        when an interrupt cut that call short before (nothing of it is queued)."""
        return self.queued_for.get(request_id) is block_ids_per_group

    def _lost_keys(self, parts: list[tuple[Tier, list[int], list[int]]]) -> bool:
        """Return True when a tier block to load holds no key any more.

        A lookup pin keeps its blocks from being reused, not from being discarded: a
        failed load that named a block bad drops its keys ("never serve a suspect copy
        again"), as does a cascade move that replaces a stale disk copy, and a request
        that pinned the block before must not read it either.
        """
        pools = self.index.pools
        return any(None in pools[tier].keys(ids) for tier, ids, _ in parts)

    def _accepted_hit(
        self, request: RequestView, pin: LookupPin, num_tokens: int
    ) -> LongestHit | None:
        """Return the hit serving exactly the accepted `num_tokens`, or None if none does.

        The first blocks of a longer hit serve a shorter prefix only in full-attention
        groups: a sliding window or a state needs the blocks just before the shorter
        end, which the longer hit left null. Those are looked up again.
        """
        hit = pin.hit
        if num_tokens == hit.num_tokens or self._prefix_only:
            return hit
        hashes = request.block_hashes[pin.num_local_tokens // self.layout.hash_block_size :]
        cached = self._cached_fn(request)
        shorter = find_longest_hit(
            self.layout, hashes, num_tokens, cached, self.granularity, self.eagle_proof
        )
        return shorter if shorter.num_tokens == num_tokens else None

    def _cached_fn(self, request: RequestView) -> CachedBlockFn:
        """Return the tier lookup of a hit: the index's own, or with the token check on,
        one that also requires the tag of the block's key to be the request's tag of its
        hash (a block with no tag, or a hash the request holds twice, is a plain miss)."""
        if self.tags is None:
            return self.index.cached_block
        expected = self.tags.expected(request)
        index = self.index

        def checked(key: Key) -> int | None:
            block_id = index.cached_block(key)
            if block_id is None:
                return None
            tag = index.tag(block_id, key)
            want = expected(key_block_hash(key))
            if tag is not None and tag == want:
                return block_id
            if tag is not None and want is not None:
                seen = self._mismatches_seen.setdefault(request.request_id, set())
                if (block_id, key) in seen:
                    return None
                seen.add((block_id, key))
                self.num_tag_mismatches += 1
                logger.warning(
                    "request %s: tier block %d holds key %s with other tokens (a hash "
                    "collision); not served",
                    request.request_id,
                    block_id,
                    key.hex()[:16],
                )
            return None

        return checked

    def release_pin(self, request_id: str) -> None:
        """Drop a request's lookup pin, if any: free the tier blocks it holds."""
        pin = self.pins.pop(request_id, None)
        if pin is not None:
            self.index.free(pin.pinned)

    def take_queued(self) -> list[LoadItem]:
        """Return and forget the queued loads."""
        queued, self.queued = self.queued, []
        return queued

    def drop_request(self, request_id: str) -> bool:
        """Drop a finished request's pin, queued loads and loads failed before issue;
        return True if it had one (no report will name it)."""
        assert self.gpu_pool is not None, "no GPU pool bound"
        self.release_pin(request_id)
        self.allocated.discard(request_id)
        self.looked_up.discard(request_id)
        self.queued_for.pop(request_id, None)
        self.recompute_next.discard(request_id)
        self.recompute_unasked.discard(request_id)
        self._mismatches_seen.pop(request_id, None)
        keep = []
        dropped = False
        for load in self.queued:
            if load.request_id == request_id:
                self.index.pools[load.tier].free(load.tier_block_ids[::-1])
                self.gpu_pool.free(load.gpu_block_ids[::-1])
                dropped = True
            else:
                keep.append(load)
        self.queued = keep
        if self.book.has_unissued_failures():
            dropped |= self.book.drop_unissued_failures(request_id)
        return dropped

    def fail_all(self) -> None:
        """Drop every pin and queued load; the loads come back as failed (reset)."""
        assert self.gpu_pool is not None, "no GPU pool bound"
        self._mismatches_seen.clear()  # the tier's blocks are emptied
        for request_id in list(self.pins):
            self.release_pin(request_id)
        for load in self.take_queued():
            self.index.pools[load.tier].free(load.tier_block_ids[::-1])
            self.gpu_pool.free(load.gpu_block_ids[::-1])
            load.progress.num_pending -= 1
            if load.progress.num_pending == 0:  # every part of a load is queued together
                self.book.fail_unissued(load.progress.failure())


def _check_count(name: str, value: int) -> None:
    """Raise ValueError naming `name` unless `value` is a token count (an int >= 0)."""
    try:
        count = operator.index(value)
    except TypeError:
        count = -1
    if count < 0 or isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
