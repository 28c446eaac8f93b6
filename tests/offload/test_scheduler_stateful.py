"""Random engine runs against the offload scheduler, checked against a model (SPEC §6).

Requests share prefixes (two families), are looked up (some with a cap, some declined
and their pin released), admitted taking all, none or part of their tier hit, run in
chunks, decode, finish, are preempted or aborted (a new request may take the id of one
whose load is still in flight, as in an engine whose ids repeat); the GPU cache is
evicted and the scheduler reset at random; 1-4 fake workers complete, delay, fail or
re-report transfers in any order, or report events never issued; a worker may find some
source slots of a load corrupted (they hold garbage from then on, and every load of them
on that worker fails naming them, as a checksum would tell). Eager mode runs with
and without fine-grained hits; a sliding-window or state group may join full attention.
The tier is a CPU tier, a CPU tier with a disk cascade behind it, or a disk alone (whose
failed stores' slots are held, as a cascade's failed demotions' are: `disk_slots`).
After every step:

- the scheduler's and the GPU pool's own invariants hold;
- every reference on a GPU block or tier slot is explained by the engine's tables, a
  lookup pin, a queued load or store, or a transfer not every worker has reported — so
  nothing stays pinned for a request that is gone once its transfers are reported;
- a key is visible in the tier only if a store holding it completed on every worker
  without failure and was not abandoned by a reset, and every worker holds its bytes
  (but a corrupted slot, while the load that found it is not reported by every worker);
- loads deliver the right content (`SimEngine.check_kv`, on load completion and before
  every forward pass).

At teardown everything is drained: every tier slot is free and the GPU holds no pin, and
once the disk works, every write-through demotion that failed (a worker's "fail") is
retried until it succeeds; then every block a write-through CPU tier holds is on disk
too, unless its demotion was given up or the disk lost a copy of its key since
(`disk_coverage`).

Each step's many small choices come from one drawn seed: with one draw per choice,
Hypothesis spent most of the time generating data and ran far fewer steps. `note()`
records the choices, so a failing example still reads as a story.
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
from scheduler_model_checks import LazySchedulerMachine, SchedulerMachine

from example_counts import scaled_examples

STATEFUL_SETTINGS = settings(
    max_examples=scaled_examples(1000),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CASCADE_SETTINGS = settings(STATEFUL_SETTINGS, max_examples=scaled_examples(400))
SchedulerMachine.TestCase.settings = STATEFUL_SETTINGS
LazySchedulerMachine.TestCase.settings = STATEFUL_SETTINGS
# Write-through runs as many examples as the plain ones: with 400, a key stored again
# while its other block's demotion is in flight came up in about half the seeds only.
WriteThroughMachine.TestCase.settings = STATEFUL_SETTINGS
WriteThroughLazyMachine.TestCase.settings = CASCADE_SETTINGS
WriteBackMachine.TestCase.settings = CASCADE_SETTINGS
WriteBackLazyMachine.TestCase.settings = CASCADE_SETTINGS
DiskOnlyMachine.TestCase.settings = CASCADE_SETTINGS
DiskOnlyLazyMachine.TestCase.settings = CASCADE_SETTINGS
test_eager_scheduler_runs_match_the_model = SchedulerMachine.TestCase
test_lazy_scheduler_runs_match_the_model = LazySchedulerMachine.TestCase
test_write_through_cascade_runs_match_the_model = WriteThroughMachine.TestCase
test_write_through_lazy_cascade_runs_match_the_model = WriteThroughLazyMachine.TestCase
test_write_back_cascade_runs_match_the_model = WriteBackMachine.TestCase
test_write_back_lazy_cascade_runs_match_the_model = WriteBackLazyMachine.TestCase
test_disk_only_runs_match_the_model = DiskOnlyMachine.TestCase
test_disk_only_lazy_runs_match_the_model = DiskOnlyLazyMachine.TestCase
