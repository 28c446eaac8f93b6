"""What the offload scheduler's random engine runs are built from (SPEC §6).

The draws `SchedulerDriver` makes: two prefix families, request extras, worker actions,
the tiers' policies and `SETUP_ARGS`, the layouts and tiers `SchedulerSetup.setup`
builds a `SimEngine` from. `SchedulerSetup` holds the engine, the records the model
checks in `test_scheduler_stateful` need, and views of its references (`Slot`).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize
from sim import BYTES_PER_BLOCK, SimEngine, SimRequest, full_layout

from kvtier.core.extra_keys import MultiModalItem, RequestExtras
from kvtier.core.keys import BlockHash, Key
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.offload.config import CascadeMode, OffloadConfig, StoreMode
from kvtier.offload.protocols import LoRAInfo

HASH_BLOCK = 4
FAMILIES = [[1000 * f + i for i in range(12)] for f in range(2)]
MAX_LIVE_REQUESTS = 4
SEEDS = st.integers(0, 2**32 - 1)
# What besides tokens a request's hashes take: mostly nothing, else a LoRA adapter, a
# cache salt, an image across the first two hash blocks, or a LoRA and a salt. Requests
# of a family with other extras share tokens, never KV.
LORA = LoRAInfo(1, "adapter")
EXTRAS: list[tuple[LoRAInfo | None, RequestExtras]] = [(None, RequestExtras())] * 4 + [
    (LORA, RequestExtras()),
    (None, RequestExtras(cache_salt="tenant")),
    (None, RequestExtras(mm_items=(MultiModalItem("image", 2, 4),))),
    (LORA, RequestExtras(cache_salt="tenant")),
]
WORKER_ACTIONS = ["done"] * 6 + ["wait"] * 3 + ["fail", "corrupt"]
# The tiers' (eviction, admission) policies: LRU alone half the time, else any other pair.
OTHER_POLICIES = [
    (eviction, admission)
    for eviction in EVICTION_POLICIES
    for admission in ADMISSION_POLICIES
    if (eviction, admission) != ("lru", "all")
]
POLICIES = [("lru", "all")] * len(OTHER_POLICIES) + OTHER_POLICIES
SETUP_ARGS = {  # `SchedulerDriver.setup`'s draws (a subclass's own setup may add some)
    "num_workers": st.integers(1, 4),
    "num_gpu_blocks": st.integers(8, 16),
    "num_tier_blocks": st.integers(3, 8),
    "fine": st.booleans(),
    "num_disk_blocks": st.integers(3, 10),
    # Groups beside full attention: none, a sliding window, a state, a scratch group, or
    # both a sliding window and a state.
    "second": st.sampled_from(
        [None, None, GroupKind.SLIDING_WINDOW, GroupKind.STATE, GroupKind.SCRATCH, "both"]
    ),
    "token_check": st.booleans(),
    "policy": st.sampled_from(POLICIES),
    "events": st.booleans(),
}


def refs(pool_refs: list[int]) -> Counter[int]:
    return Counter({b: r for b, r in enumerate(pool_refs) if r})


Slot = tuple[str, int]  # (lower tier name, block id)


def tagged(tier_name: str, counts: Counter[int]) -> Counter[Slot]:
    return Counter({(tier_name, b): n for b, n in counts.items()})


class SchedulerSetup(RuleBasedStateMachine):
    """The engine a run drives, built from `SETUP_ARGS`, the run's records, and views.

    `SchedulerDriver` adds the rule; subclasses add the checks and pick the store mode.
    """

    mode = StoreMode.EAGER
    cascade: CascadeMode | None = None
    disk_only = False  # the one tier is a disk (no cascade): GPU blocks are stored to disk
    preempts_scheduled = False  # the engine may preempt a request it scheduled (`SimEngine`)

    def __init__(self) -> None:
        super().__init__()
        self.engine: SimEngine
        self.waiting: dict[str, SimRequest] = {}  # new or preempted: no GPU blocks
        self.lookup_pins: dict[str, Counter[Slot]] = {}  # tier slots a lookup pinned
        self.queued_loads: dict[str, tuple[Counter[Slot], Counter[int]]] = {}  # tier, GPU
        self.abandoned: set[int] = set()  # store and demotion events in flight at a reset
        self.legit: set[tuple[str, Key]] = set()  # (tier, key) a completed, kept copy holds
        self.expect_failed: set[str] = set()  # queued loads a reset dropped
        self.num_seen_reports = 0
        self.next_id = 0
        self.hits_reported = 0  # cumulative hit tokens at the last take_stats
        self.event_keys: dict[str, Counter[tuple[BlockHash, int]]] = {}  # per tier, replayed
        self.admitted = False  # this step's admissions ran (`abort`)

    @initialize(**SETUP_ARGS)
    def setup(
        self,
        num_workers: int,
        num_gpu_blocks: int,
        num_tier_blocks: int,
        fine: bool,
        num_disk_blocks: int,
        second: GroupKind | str | None,
        token_check: bool,
        policy: tuple[str, str],
        events: bool,
    ) -> None:
        """Build the engine: one full-attention group of 4 (or 8 with fine-grained hits).

        `second` adds a group of 4: a sliding window of 8 tokens (the engine nulls blocks
        that left it), a recurrent state (stored from hand-offs), a scratch group (never
        stored or loaded), or ("both") a sliding window and a state. A cascade machine
        puts a disk tier of `num_disk_blocks` behind the CPU tier; a disk-only machine's
        one tier of `num_tier_blocks` is a disk. `token_check` (eager
        only) tags every store and checks every hit's tags. `policy` is the tiers'
        (eviction, admission) pair: no check below depends on which blocks it keeps.
        `events` has the tiers record KV events (registration takes its per-block path).
        """
        fine = fine and self.mode is StoreMode.EAGER
        token_check = token_check and self.mode is StoreMode.EAGER
        layout = full_layout(8, HASH_BLOCK) if fine else full_layout(4)
        kinds = [GroupKind.SLIDING_WINDOW, GroupKind.STATE] if second == "both" else [second]
        for kind in kinds:
            if isinstance(kind, GroupKind):
                window = 8 if kind is GroupKind.SLIDING_WINDOW else None
                group = KVGroupSpec(kind, HASH_BLOCK, BYTES_PER_BLOCK, window)
                layout = KVLayout((*layout.groups, group), HASH_BLOCK)
        tiers: dict[str, object] = {"cpu_bytes": 0 if self.disk_only else 1 << 20}
        if self.cascade is not None or self.disk_only:
            tiers.update(disk_bytes=1 << 21, disk_path="unused-by-the-fake-worker")
        if self.cascade is not None:
            tiers["cascade"] = self.cascade
        cfg = OffloadConfig(
            store_mode=self.mode,
            max_batched_tokens=8,
            fine_grained_hits=fine,
            token_check=token_check,
            eviction_policy=policy[0],
            admission_policy=policy[1],
            events=events,
            **tiers,  # type: ignore[arg-type]
        )
        self.engine = SimEngine(
            layout,
            cfg,
            num_gpu_blocks=num_gpu_blocks,
            num_tier_blocks=num_tier_blocks,
            num_workers=num_workers,
            num_disk_blocks=num_disk_blocks if self.cascade is not None else 0,
            preempts_scheduled=self.preempts_scheduled,
        )
        self.engine.auto_complete = False

    # ------------------------------------------------------------ views

    def group_id(self, kind: GroupKind) -> int | None:
        """Return the id of the layout's group of `kind`, if it has one."""
        groups = self.engine.layout.groups
        return next((i for i, g in enumerate(groups) if g.kind is kind), None)

    @property
    def block_size(self) -> int:
        return self.engine.layout.groups[0].block_size

    def live_ids(self) -> list[str]:
        return sorted([*self.waiting, *self.engine.requests])

    def tier_refs(self) -> Counter[Slot]:
        counts: Counter[Slot] = Counter()
        for tier, pool in self.engine.scheduler.index.pools.items():
            counts += tagged(tier.value, refs([pool.ref_count(b) for b in range(pool.num_blocks)]))
        return counts

    def gpu_refs(self) -> Counter[int]:
        gpu = self.engine.gpu
        return refs([gpu.ref_count(b) for b in range(gpu.num_blocks)])
