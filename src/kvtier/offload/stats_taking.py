"""Taking an offload scheduler's stats (SPEC §6.10): each step's counters, the gauges
and the cumulative totals as one `OffloadStats`, every count reported once."""

from __future__ import annotations

from kvtier.offload.cascade import Cascade, CascadeCounters
from kvtier.offload.completion import TransferCompletion
from kvtier.offload.config import OffloadConfig
from kvtier.offload.load_planner import LoadPlanner
from kvtier.offload.plan import Tier
from kvtier.offload.stats import OffloadStats, StepCounters


class StatsTaker:
    """Builds `OffloadStats` from the scheduler's counters and remembers what the last
    take reported of the cumulative counts (hit tokens, tag mismatches)."""

    def __init__(
        self,
        counters: StepCounters,
        loads: LoadPlanner,
        completion: TransferCompletion,
        cascade: Cascade | None,
        tier_names: tuple[str, ...],
        bytes_per_slot: int,
        info: dict[str, str],
    ) -> None:
        self._counters = counters
        self._loads = loads
        self._completion = completion
        self._cascade = cascade
        self._tier_names = tier_names
        self._bytes_per_slot = bytes_per_slot
        self._info = info  # fixed for the scheduler's life
        self._hit_tokens_taken = 0  # total hit tokens at the last take
        self._tag_mismatches_taken = 0  # total tag mismatches at the last take

    def has_new_counts(self) -> bool:
        """Return True when `take` would report a non-zero counter or new hit tokens."""
        cascade = self._cascade
        return (
            not self._counters.is_zero()
            or self._completion.num_promoted > 0
            or sum(self._loads.hit_tokens.values()) != self._hit_tokens_taken
            or self._loads.num_tag_mismatches != self._tag_mismatches_taken
            or (cascade is not None and cascade.counters != CascadeCounters())
        )

    def take(
        self,
        num_tier_blocks_in_use: int,
        num_blocks_pending_store: int,
        num_disk_slots_held: int,
    ) -> OffloadStats:
        """Return this step's counters (then reset them), the gauges given and the totals."""
        counters = self._counters
        bytes_per_block = self._bytes_per_slot
        hit_tokens = self._loads.hit_tokens
        self._hit_tokens_taken = sum(hit_tokens.values())
        cascade = self._cascade.take_counters() if self._cascade is not None else None
        completion = self._completion
        promoted, completion.num_promoted = completion.num_promoted, 0
        mismatches = self._loads.num_tag_mismatches - self._tag_mismatches_taken
        self._tag_mismatches_taken = self._loads.num_tag_mismatches
        stats = OffloadStats(
            store_outcomes=dict(counters.store_outcomes),
            handoff_outcomes=dict(counters.handoff_outcomes),
            num_loaded_blocks=counters.num_loaded_blocks,
            num_stored_blocks=counters.num_stored_blocks,
            num_failed_loads=counters.num_failed_loads,
            num_failed_stores=counters.num_failed_stores,
            num_bytes_loaded=counters.num_loaded_blocks * bytes_per_block,
            num_bytes_stored=counters.num_stored_blocks * bytes_per_block,
            num_tier_blocks_in_use=num_tier_blocks_in_use,
            num_blocks_pending_store=num_blocks_pending_store,
            num_disk_slots_held=num_disk_slots_held,
            hit_tokens={name: hit_tokens[name] for name in self._tier_names},
            num_demoted_blocks=cascade.num_demoted_blocks if cascade else 0,
            num_failed_demotions=cascade.num_failed_demotions if cascade else 0,
            num_dropped_demotions=cascade.num_dropped_demotions if cascade else 0,
            num_promoted_blocks=promoted,
            num_lost_blocks=cascade.num_lost_blocks if cascade else 0,
            num_tag_mismatches=mismatches,
            transfer_bytes={
                kind: blocks * bytes_per_block for kind, blocks in counters.transfer_blocks.items()
            },
            transfer_seconds=dict(counters.transfer_seconds),
            info=dict(self._info),  # a plain dict: stats are pickled, copied, logged
        )
        counters.clear()
        return stats


def info_labels(
    config: OffloadConfig, tier: Tier, num_tier_blocks: int, cascade: Cascade | None
) -> dict[str, str]:
    """Return the stats' info labels of a scheduler whose first tier is `tier`, of
    `num_tier_blocks` blocks (with `cascade`, a disk tier below it)."""
    info = {
        "tier": tier.value,
        "store_mode": config.store_mode.value,
        "num_tier_blocks": str(num_tier_blocks),
    }
    if tier is Tier.DISK or cascade is not None:  # no disk, no I/O mode
        info["disk_io_mode"] = config.disk_io_mode.value
    if cascade is not None:
        info["cascade"] = config.cascade.value
        info["num_disk_blocks"] = str(cascade.disk_pool.num_blocks)
    return info
