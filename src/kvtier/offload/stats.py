"""Per-step statistics and cumulative counters of the offload scheduler (SPEC §6.10)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class StoreOutcome(enum.Enum):
    """What happened to one candidate for storing."""

    STORED = "stored"
    ALREADY_CACHED = "skipped_already_cached"
    STORED_BEFORE = "skipped_stored_before"  # lazy: copied from this GPU block before
    IN_FLIGHT = "skipped_in_flight"
    TIER_FULL = "dropped_tier_full"  # no slot, and nothing retries it
    DEFERRED = "deferred_tier_full"  # no slot yet: eager/lazy retry it (counted once)
    REQUEST_GONE = "dropped_request_gone"
    NULL = "dropped_null"
    UNHASHED = "dropped_unhashed"
    NOT_ADMITTED = "dropped_not_admitted"  # the tier's admission policy refused it
    NO_TAG = "skipped_no_token_tag"  # token check on: no tag known for the block's KV
    # A state block keyed inside its block (`KVLayout.coarse_state_groups`): never served
    PARTIAL_STATE = "dropped_partial_state"


@dataclass(frozen=True)
class OffloadStats:
    """One step's counters (reset by `take_stats`) plus gauges and cumulative totals.

    `store_outcomes` counts eager, lazy and finish-time candidates; `handoff_outcomes`
    counts hand-offs alone. `hit_tokens` is cumulative per tier medium and counts the
    tokens of loads that completed (a failed load's tokens were recomputed); the other
    counters are this step's. `num_failed_loads` counts requests whose load failed,
    whether its copy failed or it was never issued (e.g. dropped by a reset).
    """

    store_outcomes: Mapping[str, int] = field(default_factory=dict)
    handoff_outcomes: Mapping[str, int] = field(default_factory=dict)
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_failed_loads: int = 0
    num_failed_stores: int = 0
    num_bytes_loaded: int = 0
    num_bytes_stored: int = 0
    num_tier_blocks_in_use: int = 0
    num_blocks_pending_store: int = 0
    num_disk_slots_held: int = 0  # disk slots set aside after failed writes (`disk_slots`)
    hit_tokens: Mapping[str, int] = field(default_factory=dict)
    num_demoted_blocks: int = 0  # CPU → DISK copies registered (cascade)
    num_failed_demotions: int = 0
    num_dropped_demotions: int = 0  # chosen for demotion, no disk slot free (cascade)
    num_promoted_blocks: int = 0  # disk-held blocks stored into the CPU tier (cascade)
    num_lost_blocks: int = 0  # evicted from the CPU tier with no disk copy (cascade)
    num_tag_mismatches: int = 0  # tier blocks not served: key matched, token tag did not
    # Per direction (`GPU_to_CPU`, `CPU_to_GPU`, `GPU_to_DISK`, `DISK_to_GPU`,
    # `CPU_to_DISK`): bytes of the transfers that completed this step on every worker,
    # and their copy time (each event's slowest worker). A failed load whose workers
    # named its bad blocks counts the blocks every worker copied whole (all but the bad
    # ones) and the copy time they reported; any other failed transfer counts neither.
    transfer_bytes: Mapping[str, int] = field(default_factory=dict)
    transfer_seconds: Mapping[str, float] = field(default_factory=dict)
    info: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StepCounters:
    """Mutable counters the scheduler bumps during a step."""

    # Keyed by `StoreOutcome.value`: Enum.__hash__ is a Python-level call, str's is not.
    store_outcomes: dict[str, int] = field(default_factory=dict)
    handoff_outcomes: dict[str, int] = field(default_factory=dict)
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_failed_loads: int = 0
    num_failed_stores: int = 0
    transfer_blocks: dict[str, int] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)

    def count_transfer(self, transfer_type: str, num_blocks: int, seconds: float) -> None:
        """Count one completed transfer's blocks and copy time under its direction."""
        self.transfer_blocks[transfer_type] = (
            self.transfer_blocks.get(transfer_type, 0) + num_blocks
        )
        self.transfer_seconds[transfer_type] = (
            self.transfer_seconds.get(transfer_type, 0.0) + seconds
        )

    def count_many(self, outcome: StoreOutcome, count: int) -> None:
        """Count `count` store candidates with the same outcome."""
        if count:
            name = outcome._value_
            self.store_outcomes[name] = self.store_outcomes.get(name, 0) + count

    def count_store(self, outcome: StoreOutcome) -> None:
        """Count one store candidate's outcome."""
        name = outcome._value_
        self.store_outcomes[name] = self.store_outcomes.get(name, 0) + 1

    def count_handoff(self, outcome: StoreOutcome) -> None:
        """Count one hand-off's outcome."""
        name = outcome._value_
        self.handoff_outcomes[name] = self.handoff_outcomes.get(name, 0) + 1

    def is_zero(self) -> bool:
        """Return True when nothing was counted since the last `clear`."""
        return not (
            self.store_outcomes
            or self.handoff_outcomes
            or self.num_loaded_blocks
            or self.num_stored_blocks
            or self.num_failed_loads
            or self.num_failed_stores
            or self.transfer_blocks
        )

    def clear(self) -> None:
        """Reset every counter to zero."""
        self.store_outcomes.clear()
        self.handoff_outcomes.clear()
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0
        self.num_failed_loads = 0
        self.num_failed_stores = 0
        self.transfer_blocks.clear()
        self.transfer_seconds.clear()
