"""What one scheduler step may carry and what it decided (`Scheduler.schedule`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.request import Request
from kvtier.offload.protocols import TableUpdate


@dataclass(frozen=True)
class SchedulerLimits:
    """How much work one step may carry, and `max_model_len`: the most tokens (prompt
    and output) a request may hold, where it stops with finish reason "length" as in
    vLLM (the model's `max_position`; None: no cap but `max_tokens`)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None


@dataclass(slots=True)
class ScheduledWork:
    """One request's share of a step: tokens to compute and blocks appended for them."""

    request: Request
    num_new_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...]
    table_update: TableUpdate


@dataclass(slots=True)
class SchedulerStep:
    """What `schedule` decided for one step."""

    work: list[ScheduledWork] = field(default_factory=list)
    # Requests whose GPU blocks were dropped this step (the offload side resets them, as
    # vLLM's preempted ones): preempted running ones, and `released_ids`.
    preempted_ids: set[str] = field(default_factory=set)
    # Waiting requests back from a load whose idle blocks were freed for one that could
    # not run otherwise (`Scheduler._release_idle_blocks`): not preemptions.
    released_ids: set[str] = field(default_factory=set)
    # A running request that cannot compute one more token though it could use the
    # whole pool: it never will (the engine aborts it), where preempting it would loop.
    stuck: Request | None = None
    # A running request was short of blocks that transfers are about to give back: it
    # and the running requests after it wait a step, and nothing new is admitted.
    waits_for_frees: bool = False
