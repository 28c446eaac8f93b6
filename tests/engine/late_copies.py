"""An offload worker whose copies start late: each plan's jobs reach the real worker at
a later poll, so a load can land after its request was aborted or the tier reset, and a
store can read its GPU blocks steps after it was issued (as a slow copy thread would)."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtier.offload.plan import Tier, TransferJob, TransferPlan, WorkerReport


def lane_of(job: TransferJob) -> str:
    """Return the worker lane of `job` (`transfer.routes`): loads and promotions run
    apart from stores and demotions, each lane in submission order."""
    if job.dst_tier is Tier.GPU or (job.src_tier is Tier.DISK and job.dst_tier is Tier.CPU):
        return "load"
    return "store"


class LateCopies:
    """Queue each plan's jobs per lane; at each `peek` hand the head of a lane to the real
    worker with probability `p_release[lane]` (repeatedly). A flush, a plan that asks for
    one (a preemption) and every other worker call hand everything over first, in
    submission order. A plan's `end_persistence` and `forget_slots` reach the worker at
    once: the worker applies them before the plan's jobs, as here."""

    def __init__(self, worker: Any, rng: random.Random, p_release: dict[str, float]) -> None:
        self.worker = worker
        self.rng = rng
        self.p_release = p_release
        self.queues: dict[str, deque[tuple[int, TransferPlan]]] = {
            "load": deque(),
            "store": deque(),
        }
        self.num_plans = 0

    def num_unstarted(self, lane: str) -> int:
        """Return how many jobs of `lane` the real worker has not seen yet."""
        return sum(len(plan.jobs) for _, plan in self.queues[lane])

    def submit(self, plan: TransferPlan) -> None:
        if plan.need_flush:
            self.hand_over_all()
            self.worker.submit(plan)
            return
        if plan.end_persistence or plan.forget_slots:
            self.worker.submit(dataclasses.replace(plan, jobs=()))
        for lane, queue in self.queues.items():
            jobs = tuple(job for job in plan.jobs if lane_of(job) == lane)
            if jobs:
                part = dataclasses.replace(plan, jobs=jobs, end_persistence=False, forget_slots=())
                queue.append((self.num_plans, part))
        self.num_plans += 1

    def hand_over_all(self) -> None:
        parts = sorted((*self.queues["load"], *self.queues["store"]), key=lambda p: p[0])
        for queue in self.queues.values():
            queue.clear()
        for _, part in parts:
            self.worker.submit(part)

    def peek(self) -> WorkerReport:
        for lane, queue in self.queues.items():
            while queue and self.rng.random() < self.p_release[lane]:
                self.worker.submit(queue.popleft()[1])
        report: WorkerReport = self.worker.peek()
        return report

    def flush(self) -> None:
        self.hand_over_all()
        self.worker.flush()

    def acknowledge(self) -> None:
        self.worker.acknowledge()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.worker, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.hand_over_all()
            return attr(*args, **kwargs)

        typed: Callable[..., Any] = call
        return typed
