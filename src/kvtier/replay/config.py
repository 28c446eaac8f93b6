"""What a replay is configured with and what it reports (frozen records)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.core.plural import counted
from kvtier.core.policies import PolicySpec
from kvtier.offload.config import CascadeMode  # the modes the offload scheduler runs
from kvtier.replay.belady import OFFLINE_POLICIES
from kvtier.replay.cost import DEFAULT_LINK_GBPS, CostModel, is_int, is_positive_finite
from kvtier.replay.trace import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE

# The largest token count a capacity takes, 10**18 (1000000000G): an exabyte of KV even at
# one byte per token, and below 2**63, so readers of the CSV and JSON that hold
# capacity_tokens in a 64-bit int (pandas, numpy, SQL) read it. `--capacity
# 99999999999999999999M` was taken and printed as a 26-digit number (the CLI's
# `parse_tokens` and the configs here refuse more).
MAX_TOKENS = 10**18


class ReplayError(ValueError):
    """The replay cannot model this configuration or trace."""


class ReleaseOrder(enum.Enum):
    """When and in which order a request's tier blocks are freed (= their recency order).

    TAIL_FIRST: hit blocks stay pinned until the request's stores are registered, then
    all of the request's tier blocks are freed last position first (SPEC §4's intent:
    prefix tails are evicted before their roots). The README's reference model.
    SCHEDULER_TAIL_FIRST: what `OffloadScheduler` does: the hits are pinned last
    position first (its lookup pin; `duel`'s shadows see them in that order); a
    finished load frees its blocks before the request's stores allocate their slots;
    the stores are freed when they complete; each free last position first
    (tests/replay/test_scheduler_parity.py).
    SCHEDULER: the same timing with each free in position order (the scheduler's order
    before it freed tail first; kept for comparison, docs/policies.md).
    """

    TAIL_FIRST = "tail_first"
    SCHEDULER = "scheduler"
    SCHEDULER_TAIL_FIRST = "scheduler_tail_first"


@dataclass(frozen=True)
class TierConfig:
    """One lower tier: its name, capacity in tokens and load link in GB/s."""

    name: str
    capacity_tokens: int
    link_gbps: float

    def __post_init__(self) -> None:
        if not is_int(self.capacity_tokens):
            raise ReplayError(
                f"tier {self.name}: capacity must be an int (tokens), got {self.capacity_tokens!r}"
            )
        if self.capacity_tokens <= 0:
            raise ReplayError(
                f"tier {self.name}: capacity must be > 0 tokens, got {self.capacity_tokens}"
            )
        if self.capacity_tokens > MAX_TOKENS:
            raise ReplayError(
                f"tier {self.name}: capacity_tokens must be at most {MAX_TOKENS:,} (10**18), "
                f"got {self.capacity_tokens}"
            )
        if not is_positive_finite(self.link_gbps):
            raise ReplayError(
                f"tier {self.name}: link_gbps must be a number > 0 and finite, got "
                f"{self.link_gbps!r}"
            )

    @staticmethod
    def named(name: str, capacity_tokens: int) -> TierConfig:
        """Return a tier with the default link of `name` (CPU 25 GB/s, DISK 5 GB/s)."""
        return TierConfig(name, capacity_tokens, DEFAULT_LINK_GBPS[name])


@dataclass(frozen=True)
class ReplayConfig:
    """What to replay: tiers, the policy of the lower tiers, the model's choices."""

    tiers: tuple[TierConfig, ...]
    policy: str = "lru"  # a PolicySpec name, or "belady" / "oracle-lfu" (offline)
    gpu_capacity_tokens: int = 0  # 0: no GPU prefix cache in front
    block_size: int = DEFAULT_BLOCK_SIZE
    release_order: ReleaseOrder = ReleaseOrder.TAIL_FIRST
    cost: CostModel = field(default_factory=CostModel)
    check_every: int = 0  # call every check_invariants() each N requests (tests)
    cascade: CascadeMode | None = None  # None: independent lower tiers (see TierReplay)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ReplayError("at least one lower tier is needed")
        if not is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ReplayError(
                f"block_size must be an int in [1, {MAX_BLOCK_SIZE}] (tokens), got "
                f"{self.block_size!r}"
            )
        if not is_int(self.gpu_capacity_tokens):
            raise ReplayError(
                f"gpu_capacity_tokens must be an int (tokens), got {self.gpu_capacity_tokens!r}"
            )
        if self.gpu_capacity_tokens > MAX_TOKENS:
            raise ReplayError(
                f"gpu_capacity_tokens must be at most {MAX_TOKENS:,} (10**18), got "
                f"{self.gpu_capacity_tokens}"
            )
        if not is_int(self.check_every) or self.check_every < 0:
            raise ReplayError(f"check_every must be an int >= 0, got {self.check_every!r}")
        # A string never matched the replay's `is ReleaseOrder.X` tests and ran another order.
        _take_enum_value(self, "release_order", ReleaseOrder, "release_order")
        self._check_policy()
        if self.cascade is not None:
            self._check_cascade()  # names the tiers a cascade needs, before any clash
        _check_tier_names(self.tiers)
        for tier in self.tiers:
            if tier.capacity_tokens < self.block_size:
                raise ReplayError(
                    f"tier {tier.name}: capacity {counted(tier.capacity_tokens, 'token')} holds"
                    f" no {self.block_size}-token block"
                )
        if self.gpu_capacity_tokens < 0 or 0 < self.gpu_capacity_tokens < self.block_size:
            raise ReplayError(
                f"gpu capacity must be 0 (no GPU tier) or at least one {self.block_size}-token "
                f"block, got {self.gpu_capacity_tokens}"
            )

    def _check_policy(self) -> None:
        """Normalize the policy's name as the CLI does (" BELADY ": belady, "Arc+ALL": arc)."""
        if not isinstance(self.policy, str):
            raise ReplayError(
                f"policy must be a str such as 'lru' or 'arc+door', got {self.policy!r}"
            )
        name = self.policy.strip().lower()
        if name not in OFFLINE_POLICIES:
            offline = name.partition("+")[0].strip()
            if offline in OFFLINE_POLICIES:
                raise ReplayError(
                    f"policy {self.policy!r}: {offline!r} is offline, with its own admission "
                    "rule; it takes no admission filter"
                )
            name = PolicySpec.parse(name).name  # raises ValueError naming a bad name
        object.__setattr__(self, "policy", name)

    def _check_cascade(self) -> None:
        _take_enum_value(self, "cascade", CascadeMode, "cascade mode")
        assert isinstance(self.cascade, CascadeMode)
        names = tuple(tier.name for tier in self.tiers)
        if names != ("CPU", "DISK"):
            raise ReplayError(
                f"cascade={self.cascade.value} needs exactly two lower tiers, CPU then DISK; "
                f"got {len(names)}: {', '.join(names)}"
            )
        if self.policy in OFFLINE_POLICIES:
            raise ReplayError(
                f"cascade={self.cascade.value} works with online policies only: "
                f"{self.policy!r} ranks the current request's blocks, and a demotion moves "
                "another request's block"
            )


# Prefixes of a result row's columns that are not a lower tier's (`sweep.point_row`).
_NOT_TIER_COLUMNS = ("gpu", "total")


def _check_tier_names(tiers: tuple[TierConfig, ...]) -> None:
    """Raise ReplayError for tier names that would share a result row's columns.

    A row names each lower tier's columns by its lower-cased name (`cpu_token_hit_ratio`):
    names equal but for case, or `gpu` / `total`, would overwrite another's numbers.
    """
    seen: dict[str, str] = {}
    for tier in tiers:
        column = str(tier.name).lower()
        if column in _NOT_TIER_COLUMNS:
            raise ReplayError(
                f"tier {tier.name!r} would name the result column '{column}_token_hit_ratio', "
                "which is not a lower tier's; give it another name"
            )
        if column in seen:
            raise ReplayError(
                f"tiers {seen[column]!r} and {tier.name!r} both name the result columns "
                f"'{column}_...'; tier names must differ, ignoring case"
            )
        seen[column] = tier.name


def _take_enum_value(config: object, field_name: str, kind: type[enum.Enum], what: str) -> None:
    """Replace `config`'s field given as its enum's value ("write_back") by the member;
    raise ReplayError naming an unknown one with the choices."""
    value = getattr(config, field_name)
    if isinstance(value, kind):
        return
    try:
        object.__setattr__(config, field_name, kind(value))
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise ReplayError(f"unknown {what} {value!r}; choose one of {choices}") from None


@dataclass(frozen=True)
class TierResult:
    """What one tier did over the replay."""

    name: str
    capacity_tokens: int
    num_blocks: int  # usable blocks
    hit_tokens: int
    token_hit_ratio: float  # hit tokens / all prompt tokens
    num_hit_blocks: int
    num_stored_blocks: int
    num_evicted_blocks: int
    num_rejected_blocks: int  # refused by the admission policy
    num_dropped_blocks: int  # no free slot (every slot pinned by the request)
    bytes_stored: int
    bytes_loaded: int
    # Cascade only (0 otherwise), on the CPU tier's result: blocks it wrote down to DISK
    # (write-through copies, write-back moves of evicted blocks; = DISK's stored blocks)
    # and DISK-served blocks it stored (promotions).
    num_demoted_blocks: int = 0
    num_promoted_blocks: int = 0


@dataclass(frozen=True)
class ReplayResult:
    """Per-tier results, the lower tiers' combined hit ratio and the TTFT estimate."""

    policy: str
    num_requests: int
    num_prompt_tokens: int
    gpu: TierResult | None
    tiers: tuple[TierResult, ...]
    token_hit_ratio: float  # lower tiers together
    total_token_hit_ratio: float  # GPU + lower tiers
    mean_ttft_s: float
    mean_ttft_no_cache_s: float
    runtime_s: float
    cascade: CascadeMode | None = None
