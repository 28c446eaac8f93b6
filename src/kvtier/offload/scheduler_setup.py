"""What an `OffloadScheduler` is built from (`SchedulerSetup`), and its disk cascade.

`make_cascade` builds the CPU → DISK half of a CPU+disk cascade config: the disk tier's
index (a second `BlockPool`, with the config's eviction policy) and the `Cascade` that
demotes into it, with its write-back reserve and write-through retry bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.core.keys import Key
from kvtier.core.kv_groups import KVLayout
from kvtier.core.policies import PolicySpec
from kvtier.offload.cascade import Cascade
from kvtier.offload.config import OffloadConfig
from kvtier.offload.dropped_slots import DroppedSlots
from kvtier.offload.lazy_walk import lazy_target
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import GpuPoolView


@dataclass(frozen=True)
class SchedulerSetup:
    """What the offload scheduler is built from, besides its config.

    `num_tier_blocks` sizes the first lower tier; `num_disk_blocks` the disk tier
    behind it when the config is a CPU+disk cascade. `bytes_per_slot` is what one tier
    slot (one block id's copy) holds, for the byte counters of `take_stats`; 0 means
    `layout.bytes_per_block`, every group's page bytes (a block id spanning all groups'
    tensors, as in the reference engine). vLLM's groups share one allocation, so there a
    slot holds less (`adapters.vllm.layout.bytes_per_slot`). `queue_by_priority`:
    the engine orders waiting requests by priority, not arrival (`LoadPlanner`, offers).
    `preempts_scheduled`: the engine may preempt a request it scheduled earlier in the
    same step, its blocks of that step hashed but never written (vLLM's priority
    policy): the end of each request's last scheduled step is kept for that
    (`PlanAssembler`).
    `eagle_drafter`: the engine drafts with an EAGLE-style drafter (its draft KV of a
    position saw the next token): hits need the unit after them cached in attention
    groups (`core.longest_hit`).
    """

    layout: KVLayout
    num_tier_blocks: int
    num_workers: int = 1
    gpu_pool: GpuPoolView | None = None
    num_disk_blocks: int = 0
    bytes_per_slot: int = 0
    queue_by_priority: bool = False
    preempts_scheduled: bool = False
    eagle_drafter: bool = False


def make_cascade(
    config: OffloadConfig,
    setup: SchedulerSetup,
    policy: PolicySpec,
    cpu_pool: BlockPool,
    event: Callable[[Key, int | None], BlockStored],
    dropped: DroppedSlots,
) -> Cascade | None:
    """Return the cascade of a CPU+disk config over `cpu_pool`, or None for one tier.

    Raises ValueError for a disk tier of fewer than 2 blocks (block 0 is null).
    """
    if not config.is_cascade:
        return None
    if setup.num_disk_blocks < 2:
        raise ValueError(
            f"a CPU+disk cascade needs num_disk_blocks >= 2, got {setup.num_disk_blocks}"
        )
    disk_pool = BlockPool(
        setup.num_disk_blocks,
        free_queue=policy.make_eviction(setup.num_disk_blocks),
        medium=Tier.DISK.value,
        record_events=config.events,
    )
    # The demotions a plan may add to those of its step's own stores: two steps' worth of
    # blocks (`lazy_target`), within a quarter of the CPU tier. Write-back demotes that
    # many of the next victims ahead of their eviction (demoted blocks leave the CPU tier);
    # write-through retries at most that many failed or dropped demotions a plan (after a
    # long disk fault, as many as the CPU tier holds fall due at once).
    per_plan = min(
        lazy_target(setup.layout, config.max_batched_tokens),
        max(1, (setup.num_tier_blocks - 1) // 4),
    )
    return Cascade(
        cpu_pool,
        disk_pool,
        config.cascade,
        reserve=per_plan,
        event=event,
        dropped=dropped,
        retries_per_plan=per_plan,
    )
