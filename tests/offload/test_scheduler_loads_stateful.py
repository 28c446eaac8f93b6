"""Load-heavy random engine runs against the offload scheduler (SPEC §6).

The runs of `test_scheduler_stateful`, reshaped by `LoadHeavy` so that loads are
common (about 1 lookup in 5 queues one; 1 in 40 tier hits there): tiers warmed up with
the prefixes, a GPU pool barely larger than one request, three short prefixes most
requests reuse, loads lingering over steps and completing, failing whole or failing
named slots in any order, loading requests aborted, ids reused, resets. Besides every
model check of those runs, after every step each request not waiting for a load finds
its own prefix's KV in every block it reads, and each cached GPU block holds its key's
KV (`LoadHeavy.kv_is_right`).
Tiers: CPU, disk only, and CPU+disk cascades write-through and write-back, each with
eager and lazy store selection.
"""

from __future__ import annotations

from disk_tier_machines import (
    DiskOnlyLazyMachine,
    DiskOnlyMachine,
    WriteBackLazyMachine,
    WriteBackMachine,
    WriteThroughLazyMachine,
    WriteThroughMachine,
)
from hypothesis import HealthCheck, settings
from load_heavy_machine import LoadHeavy
from scheduler_model_checks import LazySchedulerMachine, SchedulerMachine

from example_counts import scaled_examples

# 150 examples per machine: the file runs in about 30 s; on the code before 07e84d8 (a
# finished request's load outcome given to a new one of its id) about half the machines
# fail within 100 examples.
LOAD_SETTINGS = settings(
    max_examples=scaled_examples(150),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LoadHeavyEager(LoadHeavy, SchedulerMachine):
    """A CPU tier, eager store selection."""


class LoadHeavyLazy(LoadHeavy, LazySchedulerMachine):
    """A CPU tier, lazy store selection."""


class LoadHeavyDiskOnly(LoadHeavy, DiskOnlyMachine):
    """A disk-only tier, eager store selection."""


class LoadHeavyDiskOnlyLazy(LoadHeavy, DiskOnlyLazyMachine):
    """A disk-only tier, lazy store selection."""


class LoadHeavyWriteThrough(LoadHeavy, WriteThroughMachine):
    """A write-through CPU+disk cascade, eager store selection."""


class LoadHeavyWriteThroughLazy(LoadHeavy, WriteThroughLazyMachine):
    """A write-through CPU+disk cascade, lazy store selection."""


class LoadHeavyWriteBack(LoadHeavy, WriteBackMachine):
    """A write-back CPU+disk cascade, eager store selection."""


class LoadHeavyWriteBackLazy(LoadHeavy, WriteBackLazyMachine):
    """A write-back CPU+disk cascade, lazy store selection."""


MACHINES = [
    LoadHeavyEager,
    LoadHeavyLazy,
    LoadHeavyDiskOnly,
    LoadHeavyDiskOnlyLazy,
    LoadHeavyWriteThrough,
    LoadHeavyWriteThroughLazy,
    LoadHeavyWriteBack,
    LoadHeavyWriteBackLazy,
]
for machine in MACHINES:
    machine.TestCase.settings = LOAD_SETTINGS
test_eager_load_heavy_runs = LoadHeavyEager.TestCase
test_lazy_load_heavy_runs = LoadHeavyLazy.TestCase
test_disk_only_load_heavy_runs = LoadHeavyDiskOnly.TestCase
test_disk_only_lazy_load_heavy_runs = LoadHeavyDiskOnlyLazy.TestCase
test_write_through_load_heavy_runs = LoadHeavyWriteThrough.TestCase
test_write_through_lazy_load_heavy_runs = LoadHeavyWriteThroughLazy.TestCase
test_write_back_load_heavy_runs = LoadHeavyWriteBack.TestCase
test_write_back_lazy_load_heavy_runs = LoadHeavyWriteBackLazy.TestCase
