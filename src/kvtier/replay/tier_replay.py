"""Replay a trace through kvtier's tier index: `BlockPool`s with policy free queues.

The model (docs/policies.md has the full statement). Per request, in trace order:

1. GPU tier (optional, LRU): prefix lookup; the hit blocks are pinned.
2. Each lower tier, in order, continues the prefix lookup where the previous tier
   stopped (prefix hits only); its hit blocks are pinned (the scheduler's lookup pin,
   then its load pin).
3. GPU: allocate the missed blocks (evicting LRU), register their keys, free the
   request's blocks tail-first.
4. Eager stores into each lower tier, exactly as `StoreSelector.select_request` does:
   positions in order; skip a key cached when the selection starts; ask the admission
   policy; stop when no slot can be allocated; `allocate` evicts per the eviction policy.
5. "Store complete": `insert_key` (+ the policy's `note_key`); the pins of loads and
   stores are released (`free`) as the `ReleaseOrder` says: by default all together,
   last position first; or as the scheduler does (loads before the stores'
   allocation, each last position first), or that timing in position order.

A lower-tier hit therefore refreshes the block (touch, then free to the MRU end), as a
load does; blocks served by the GPU are not touched in the lower tiers. Keys are
`make_key(hash_id.to_bytes(8, "little"), 0)`. Token hits count each block's tokens (the
trace's last block of a prompt may be partial).

With `ReplayConfig.cascade` the tiers CPU and DISK form a cascade instead of steps 2
and 4-5 (`kvtier.replay.cascade`): one lookup serves each block from CPU or else DISK,
stores go to the CPU tier, DISK is fed write-through or by write-back demotion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtier.core.keys import Key, key_suffix
from kvtier.core.policies import RequestObserver
from kvtier.replay.belady import OFFLINE_POLICIES, FutureOracle
from kvtier.replay.cascade import Cascade
from kvtier.replay.config import (
    CascadeMode,
    ReleaseOrder,
    ReplayConfig,
    ReplayError,
    ReplayResult,
    TierConfig,
    TierResult,
)
from kvtier.replay.gpu_tier import (
    ProgressFn,
    first_tier_oracle,
    make_gpu_pool,
    request_tokens,
    serve_on_gpu,
)
from kvtier.replay.tier_store import Placed, TierState, make_tier, store_missing
from kvtier.replay.trace import TraceRecord
from kvtier.replay.trace_checks import check_records

__all__ = [
    "CascadeMode",
    "ReleaseOrder",
    "ReplayConfig",
    "ReplayError",
    "ReplayResult",
    "TierConfig",
    "TierReplay",
    "TierResult",
    "max_blocks_held",
    "record_keys",
    "replay_trace",
    "trace_keys",
]


def trace_keys(records: Sequence[TraceRecord], block_size: int) -> list[list[Key]]:
    """Return each request's keys: `make_key(hash_id.to_bytes(8, "little"), 0)`, interned.

    Checks the records first as `read_trace` checks a file's (`trace_checks.check_records`):
    raises `TraceError` naming the record (its index) and the bad value where a record is
    not a `TraceRecord` of ints, a count is < 0, a hash id is outside [0, 2**64), the hash
    ids do not match `input_length` at `block_size`, a timestamp is before the previous
    record's, or the ids are not chained prefix hashes (an id repeats within the record,
    follows another id than where first seen, or covers other tokens than there: replayed,
    false prefix hits). Records `read_trace` returned are checked: `record_keys`."""
    check_records(records, block_size)
    return record_keys(records)


def record_keys(records: Sequence[TraceRecord]) -> list[list[Key]]:
    """Return `trace_keys`'s keys without checking the records (`read_trace`'s are)."""
    suffix = key_suffix(0)  # make_key(h, 0) == h + suffix
    interned: dict[int, Key] = {}
    for record in records:
        for hash_id in record.hash_ids:
            if hash_id not in interned:
                interned[hash_id] = hash_id.to_bytes(8, "little") + suffix
    return [[interned[hash_id] for hash_id in record.hash_ids] for record in records]


def max_blocks_held(keys: Sequence[Sequence[Key]]) -> int:
    """Return the most blocks a tier (or the GPU pool) can ever hold for these requests:
    the number of distinct keys (`keys` as `trace_keys` returns them: none repeats within
    a request). A pool of at least that many usable blocks never evicts: the request's
    pinned blocks are among them.
    """
    return len({key for row in keys for key in row})


class TierReplay:
    """One pass of a trace through a GPU pool (optional) and the lower tiers.

    A tier or GPU pool larger than the trace can fill allocates only `max_tier_blocks`
    usable blocks (default `max_blocks_held(keys)`); it never evicts either way, so the
    results (which report the configured sizes) are those of the full size.

    Offline policies read the future of the references that reach their tier
    (`_offline_oracles`): `oracle`, shared by a sweep, serves the first tier (built by
    `first_tier_oracle` for this config's GPU tier); `tier_oracles` gives every tier's (a
    replay of the tiers in front). `progress` hears of those setup passes' requests.
    `keys`: the records' keys as `trace_keys(records, config.block_size)` returns them
    (None: computed here, which checks the records' chains; given, they are not checked).
    """

    def __init__(
        self,
        records: Sequence[TraceRecord],
        config: ReplayConfig,
        keys: Sequence[Sequence[Key]] | None = None,
        oracle: FutureOracle | None = None,
        max_tier_blocks: int | None = None,
        tier_oracles: Sequence[FutureOracle] | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.records = records
        self.config = config
        self.keys = keys if keys is not None else trace_keys(records, config.block_size)
        bs = config.block_size
        cap = max_tier_blocks if max_tier_blocks is not None else max_blocks_held(self.keys)
        self._tokens = request_tokens(records, bs)
        self._cap = cap
        self.gpu_pool = make_gpu_pool(records, config, cap)
        if config.policy in OFFLINE_POLICIES and tier_oracles is None:
            tier_oracles = self._offline_oracles(oracle, progress)
        self.tiers: list[TierState] = [
            make_tier(tier, config.policy, bs, self._oracle_of(t, tier_oracles), max(1, cap))
            for t, tier in enumerate(config.tiers)
        ]
        self._reach_ends: list[int] | None = None  # recorded for a tier behind this replay's
        self.cascade: Cascade | None = None
        if config.cascade is not None:
            cpu, disk = self.tiers
            self.cascade = Cascade(config.cascade, cpu, disk, config.release_order)
        policies: list[object] = [t.eviction for t in self.tiers]
        policies += [t.admission for t in self.tiers[: 1 if self.cascade else None]]
        self._observers = [p for p in policies if isinstance(p, RequestObserver)]
        self._gpu_hit_tokens = 0
        self._gpu_hit_blocks = 0
        self._ttft_s = 0.0
        self._next = 0

    def _offline_oracles(
        self, shared: FutureOracle | None, progress: ProgressFn | None
    ) -> list[FutureOracle]:
        """Return each lower tier's oracle, built from the references that reach it.

        A reference a tier in front serves (the GPU tier, or an earlier independent tier)
        is no use to a tier behind: ranked by it, Belady's bypass could refuse a block
        whose victim is never asked for here. The tiers in front do not depend on those
        behind, so a replay of the GPU tier and tiers 0..t-1 alone tells where each
        request's references start reaching tier t.
        """
        if shared is None:
            shared = first_tier_oracle(self.records, self.config, self.keys, self._cap, progress)
        elif shared.gpu_capacity_tokens != self.config.gpu_capacity_tokens:
            raise ValueError(
                f"the first tier's oracle was built for a GPU tier of "
                f"{shared.gpu_capacity_tokens} tokens, this replay has "
                f"{self.config.gpu_capacity_tokens} (build it with first_tier_oracle)"
            )
        oracles = [shared]
        for t in range(1, len(self.config.tiers)):
            front = replace(self.config, tiers=self.config.tiers[:t], check_every=0)
            replay = TierReplay(self.records, front, self.keys, None, self._cap, oracles)
            oracles.append(FutureOracle(self.keys, replay.reach_ends(progress)))
        return oracles

    @staticmethod
    def _oracle_of(tier: int, oracles: Sequence[FutureOracle] | None) -> Callable[[], FutureOracle]:
        def get() -> FutureOracle:
            assert oracles is not None, "an offline policy without its oracles"
            return oracles[tier]

        return get

    def reach_ends(self, progress: ProgressFn | None = None) -> list[int]:
        """Replay every request; return, per request, where its prefix lookup ended: the
        first position that no tier of this replay (GPU included) served."""
        self._reach_ends = []
        self.run(progress)
        return self._reach_ends

    # ------------------------------------------------------------------ replay

    def run(self, progress: ProgressFn | None = None, progress_every: int = 256) -> ReplayResult:
        """Replay every remaining request; call `progress(n)` every `progress_every`."""
        start = time.perf_counter()
        done = 0
        while self._next < len(self.records):
            self.step()
            done += 1
            if progress is not None and done % progress_every == 0:
                progress(progress_every)
        if progress is not None and done % progress_every:
            progress(done % progress_every)
        return self.result(time.perf_counter() - start)

    def step(self) -> None:
        """Replay the next request."""
        i = self._next
        self._next += 1
        for observer in self._observers:
            observer.on_request(i)
        keys = self.keys[i]
        tokens = self._tokens[i]
        cost = self.config.cost
        bytes_per_block = self.config.block_size * cost.bytes_per_token
        g = 0
        if self.gpu_pool is not None:  # independent of the tiers behind: served first
            g = serve_on_gpu(self.gpu_pool, keys, tokens)
            self._gpu_hit_tokens += sum(tokens[:g])
            self._gpu_hit_blocks += g
        if self.cascade is not None:
            loads = list(self.cascade.lookup(keys, g))
        else:
            loads = self._lookup(keys, g)
        ttft = 0.0
        # The load pin; `scheduler_tail_first` pins tail first, as the scheduler's lookup
        # (the order `duel`'s shadows see the hits in).
        tail_first_pin = self.config.release_order is ReleaseOrder.SCHEDULER_TAIL_FIRST
        for tier, hits in zip(self.tiers, loads, strict=True):
            pinned = [block_id for _, block_id in hits]
            tier.pool.touch(pinned[::-1] if tail_first_pin else pinned)
            tier.hit_tokens += sum(tokens[j] for j, _ in hits)
            tier.hit_blocks += len(hits)
            ttft += cost.load_s(len(hits) * bytes_per_block, tier.config.link_gbps)
        end = g + sum(len(hits) for hits in loads)
        if self._reach_ends is not None:
            self._reach_ends.append(end)
        self._ttft_s += ttft + cost.prefill_s(sum(tokens[end:]))
        if self.cascade is not None:
            cpu_hits, disk_hits = loads
            self.cascade.store(keys, tokens, cpu_hits, disk_hits)
        else:
            order = self.config.release_order
            for tier, hits in zip(self.tiers, loads, strict=True):
                store_missing(tier, keys, tokens, hits, order)
        if self.config.check_every and (i + 1) % self.config.check_every == 0:
            self.check_invariants()

    def _lookup(self, keys: Sequence[Key], start: int) -> list[list[Placed]]:
        """Independent tiers: each continues the prefix where the previous one stopped."""
        loads = []
        for tier in self.tiers:
            hits = tier.pool.lookup(keys[start:]) if start < len(keys) else []
            loads.append(list(enumerate(hits, start)))
            start += len(hits)
        return loads

    # ------------------------------------------------------------------ results

    def result(self, runtime_s: float = 0.0) -> ReplayResult:
        """Return the results of the requests replayed so far."""
        replayed = self.records[: self._next]
        total_tokens = sum(r.input_length for r in replayed)
        ratio_base = max(1, total_tokens)  # ratios of 0 for a trace of empty prompts
        cost = self.config.cost
        tiers = tuple(self._tier_result(t, ratio_base) for t in self.tiers)
        gpu = None
        if self.gpu_pool is not None:
            gpu = TierResult(
                name="GPU",
                capacity_tokens=self.config.gpu_capacity_tokens,
                num_blocks=self.config.gpu_capacity_tokens // self.config.block_size,
                hit_tokens=self._gpu_hit_tokens,
                token_hit_ratio=self._gpu_hit_tokens / ratio_base,
                num_hit_blocks=self._gpu_hit_blocks,
                num_stored_blocks=0,
                num_evicted_blocks=0,
                num_rejected_blocks=0,
                num_dropped_blocks=0,
                bytes_stored=0,
                bytes_loaded=0,
            )
        lower = sum(t.hit_tokens for t in tiers)
        num = max(1, len(replayed))
        return ReplayResult(
            policy=self.config.policy,
            num_requests=len(replayed),
            num_prompt_tokens=total_tokens,
            gpu=gpu,
            tiers=tiers,
            token_hit_ratio=lower / ratio_base,
            total_token_hit_ratio=(lower + self._gpu_hit_tokens) / ratio_base,
            mean_ttft_s=self._ttft_s / num,
            mean_ttft_no_cache_s=cost.prefill_s(total_tokens) / num,
            runtime_s=runtime_s,
            cascade=self.config.cascade,
        )

    def _tier_result(self, tier: TierState, ratio_base: int) -> TierResult:
        pool = tier.pool  # at most `max_tier_blocks` blocks: the loop is bounded by the trace
        num_cached = sum(1 for b in range(1, pool.num_blocks) if pool.is_cached(b))
        block_size = self.config.block_size
        bytes_per_block = block_size * self.config.cost.bytes_per_token
        return TierResult(
            name=tier.config.name,
            capacity_tokens=tier.config.capacity_tokens,
            num_blocks=tier.config.capacity_tokens // block_size,
            hit_tokens=tier.hit_tokens,
            token_hit_ratio=tier.hit_tokens / ratio_base,
            num_hit_blocks=tier.hit_blocks,
            num_stored_blocks=tier.stored,
            num_evicted_blocks=tier.stored - num_cached,
            num_rejected_blocks=tier.rejected,
            num_dropped_blocks=tier.dropped,
            bytes_stored=tier.stored * bytes_per_block,
            bytes_loaded=tier.hit_blocks * bytes_per_block,
            num_demoted_blocks=tier.demoted,
            num_promoted_blocks=tier.promoted,
        )

    def check_invariants(self) -> None:
        """Check every pool and policy (O(pool size): for tests)."""
        if self.gpu_pool is not None:
            self.gpu_pool.check_invariants()
        for tier in self.tiers:
            tier.pool.check_invariants()
            tier.eviction.check_invariants()
            tier.admission.check_invariants()
            assert tier.pool.num_free() == tier.pool.num_usable_blocks, "a tier block stays pinned"


def replay_trace(
    records: Sequence[TraceRecord],
    config: ReplayConfig,
    keys: Sequence[Sequence[Key]] | None = None,
    oracle: FutureOracle | None = None,
    progress: ProgressFn | None = None,
) -> ReplayResult:
    """Replay `records` once under `config` and return the results; `progress` hears of
    every pass, an offline policy's setup passes included. Records whose ids are not
    chained prefix hashes are malformed: `TraceError` naming the record (`trace_keys`)."""
    return TierReplay(records, config, keys, oracle, progress=progress).run(progress)
