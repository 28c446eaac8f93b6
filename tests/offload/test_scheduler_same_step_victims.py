"""The random engine runs of `test_scheduler_stateful`, under vLLM's priority policy.

After a step's scheduling, a running request scheduled in it is sometimes preempted in
that same step, as vLLM's priority policy preempts the lowest-priority running request
for a higher one short of blocks, even one it scheduled earlier in that `schedule()`
call (`SchedulerSetup.preempts_scheduled`). vLLM has hashed the full blocks of that
step's tokens as it allocated them; it frees them with their keys, never written, and
tells kvtier only that the request was preempted. The model checks stay those of the
plain runs: no tier may take those blocks for their keys, no request may be served them
(test_same_step_preemption.py has the deterministic cases).

The victim is a running request (scheduled in an earlier step since its admission:
vLLM preempts none of the requests it takes from the waiting queue), its scheduled
tokens within the step's budget (`max_batched_tokens`; the plain runs schedule up to 12
tokens a request, past the budget of 8, which matters only here) and not yet counted
computed (vLLM counts a step's tokens as placeholders once it has scheduled it).
"""

from __future__ import annotations

import random

from disk_tier_machines import WriteBackLazyMachine, WriteThroughMachine
from hypothesis import HealthCheck, event, note, settings
from scheduler_model_checks import LazySchedulerMachine, SchedulerMachine

from example_counts import scaled_examples


class SameStepVictims(SchedulerMachine):
    """Preempt about a quarter of the running requests a step scheduled, in that step."""

    preempts_scheduled = True

    def preempt_scheduled(self, rng: random.Random) -> None:
        engine = self.engine
        budget = engine.scheduler.config.max_batched_tokens
        for request_id, num_tokens in sorted(engine.scheduled_tokens().items()):
            if not engine.ran_since_admission(request_id) or num_tokens > budget:
                continue
            if engine.requests[request_id].num_output_placeholders or rng.randrange(4):
                continue
            request, keyed = engine.preempt_scheduled(request_id)
            event("a same-step victim")
            note(f"preempt {request_id} in the step that scheduled it: keyed {sorted(keyed)}")
            self.waiting[request_id] = request


class SameStepEager(SameStepVictims):
    pass


class SameStepLazy(SameStepVictims, LazySchedulerMachine):
    pass


class SameStepWriteThrough(SameStepVictims, WriteThroughMachine):
    pass


class SameStepWriteBackLazy(SameStepVictims, WriteBackLazyMachine):
    pass


SETTINGS = settings(
    max_examples=scaled_examples(150),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for machine in (SameStepEager, SameStepLazy, SameStepWriteThrough, SameStepWriteBackLazy):
    machine.TestCase.settings = SETTINGS
test_eager_runs_with_same_step_victims = SameStepEager.TestCase
test_lazy_runs_with_same_step_victims = SameStepLazy.TestCase
test_write_through_runs_with_same_step_victims = SameStepWriteThrough.TestCase
test_write_back_lazy_runs_with_same_step_victims = SameStepWriteBackLazy.TestCase
