"""`SchedulerMachine`'s runs with a disk tier: restored copies, cascades, disk only.

`RestoredDiskMachine` starts the disk with restored copies (`restored_disk`); the
write-through machines check every CPU block reaches the disk (`DiskCoverage`); the
write-back and disk-only machines pick the tier and the store mode.
"""

from __future__ import annotations

import random
from typing import Any

from disk_coverage import DiskCoverage
from hypothesis import note
from hypothesis.stateful import initialize, invariant
from restored_disk import restore_disk
from scheduler_model_checks import SchedulerMachine
from scheduler_setup import SEEDS, SETUP_ARGS, WORKER_ACTIONS

from kvtier.core.keys import Key
from kvtier.offload.config import CascadeMode, StoreMode
from kvtier.offload.plan import Tier, TransferJob

# A demotion whose CPU source lost its keys (a failed load) mostly waits; a load of CPU
# blocks being demoted often fails (so the keys go while their demotion is in flight).
STUCK_ACTIONS = WORKER_ACTIONS + ["wait"] * 40
FLAKY_ACTIONS = WORKER_ACTIONS + ["fail"] * 10
# Other demotions linger too, so that loads of their CPU sources happen at all.
LINGERING_ACTIONS = WORKER_ACTIONS + ["wait"] * 8


class RestoredDiskMachine(SchedulerMachine):
    """The same runs with a disk that may start with restored copies of family blocks,
    with the token check on some tagged for another prefix or not at all
    (`restored_disk`): never served, and a stored copy must replace them or leave them
    be. A reset drops them all, so half the runs have none."""

    resets = True

    @initialize(**SETUP_ARGS, disk_seed=SEEDS)
    def setup(self, disk_seed: int, **kwargs: Any) -> None:
        super().setup(**kwargs)
        rng = random.Random(disk_seed)
        token_check = kwargs["token_check"] and self.mode is StoreMode.EAGER
        self.legit.update(("DISK", key) for key in restore_disk(self.engine, token_check, rng))
        self.resets = rng.randrange(2) == 0
        note(f"resets: {self.resets}")

    def incident(self, incident: int, rng: random.Random) -> None:
        """Without resets, a reset's turn reports instead (the restored copies stay)."""
        super().incident(2 if incident == 1 and not self.resets else incident, rng)


class WriteThroughMachine(RestoredDiskMachine):
    """The same runs with a CPU+disk cascade, write-through: once drained, every block
    the CPU tier holds is on disk too, or has a reason not to be (`DiskCoverage`).

    Restored disk copies the token check cannot serve must be replaced by the CPU
    copy's. Demotions linger, loads of CPU blocks being demoted often fail, and such
    demotions mostly wait (`stuck`): the key may be stored again into another CPU block
    while its demotion is in flight, and that block's demotion must wait as a retry.
    """

    cascade = CascadeMode.WRITE_THROUGH
    coverage: DiskCoverage | None = None

    @initialize(**SETUP_ARGS, disk_seed=SEEDS)
    def setup(self, disk_seed: int, **kwargs: Any) -> None:
        super().setup(disk_seed, **kwargs)
        self.demoting: dict[int, list[Key | None]] = {}  # event -> its sources' keys then

    def run_step(self) -> None:
        super().run_step()
        cpu = self.engine.scheduler.index.pools[Tier.CPU]
        for job in self.engine.worker.plans[-1].jobs:
            if job.dst_tier is Tier.DISK:
                self.demoting[job.event_id] = [cpu.key(b) for b in job.src_block_ids]

    def stuck(self, event_id: int) -> bool:
        """Whether a demotion in flight has CPU sources a load reads too or that lost the
        keys they had when it was issued."""
        worker = self.engine.worker
        then = self.demoting.get(event_id)
        if then is None or event_id not in worker.in_flight:
            return False
        cpu = self.engine.scheduler.index.pools[Tier.CPU]
        sources = worker.in_flight[event_id].job.src_block_ids
        if then != [cpu.key(b) for b in sources]:
            return True
        return any(
            f.job.src_tier is Tier.CPU
            and f.job.dst_tier is Tier.GPU
            and set(sources) & set(f.job.src_block_ids)
            for f in worker.in_flight.values()
        )

    def worker_actions(self, job: TransferJob) -> list[str]:
        if self.stuck(job.event_id):
            return STUCK_ACTIONS
        if job.dst_tier is Tier.DISK:
            return LINGERING_ACTIONS
        worker = self.engine.worker
        if (
            job.is_load
            and job.src_tier is Tier.CPU
            and worker.uses("CPU", job.src_block_ids, but=job.event_id)
        ):
            return FLAKY_ACTIONS  # a load of blocks being demoted
        return super().worker_actions(job)

    def complete_all(self) -> None:
        """Stuck demotions last: the stores the drain's aborts issued are reported first."""
        worker = self.engine.worker
        for event_id in [e for e in worker.in_flight if not self.stuck(e)]:
            worker.complete(event_id)
        self.poll()
        worker.complete_all()

    @invariant()
    def watch_disk_coverage(self) -> None:
        """Hook the cascade once, right after `setup`: before any store."""
        if self.coverage is None:
            cascade = self.engine.scheduler.cascade
            assert cascade is not None
            self.coverage = DiskCoverage(cascade)

    def check_drained(self) -> None:
        if self.coverage is None:
            return
        missing = self.coverage.missing()
        assert not missing, f"CPU blocks write-through never put on disk: {missing}"


class WriteThroughLazyMachine(WriteThroughMachine):
    """The write-through runs with lazy store selection."""

    mode = StoreMode.LAZY


class WriteBackLazyMachine(RestoredDiskMachine):
    """The same runs with a CPU+disk cascade, write-back, lazy store selection."""

    mode = StoreMode.LAZY
    cascade = CascadeMode.WRITE_BACK


class WriteBackMachine(RestoredDiskMachine):
    """The same runs with a CPU+disk cascade, write-back, eager store selection."""

    cascade = CascadeMode.WRITE_BACK


class DiskOnlyMachine(RestoredDiskMachine):
    """The same runs with a disk-only tier (no cascade), eager store selection."""

    disk_only = True


class DiskOnlyLazyMachine(RestoredDiskMachine):
    """The same runs with a disk-only tier (no cascade), lazy store selection."""

    mode = StoreMode.LAZY
    disk_only = True
