"""Property: random workloads give the same tokens through kvtier's tiers (SPEC scenario 31).

Hypothesis draws a workload: prompts built from a few shared (nested) prefixes, random
tails and follow-ups that extend an earlier answer, their sampling params, how they are
split into `generate` calls (repeated for 2-3 rounds), a GPU pool barely larger than the
longest request, and a tiny tier (CPU, disk, or a write-through / write-back cascade) with
a store mode and policies; optionally the worker finishes every copy within its step, or
reports some loads or stores as failed (failed loads also scribble over their destination
blocks). The engine with the tier must give the same tokens, and logits within float32
noise, as the same engine with offload off, call by call; the offload scheduler's
invariants hold after every call. Across all examples the tiers must really serve hits.
The workloads live in `random_workloads`, the code that runs one in `workload_runner`.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, example, given, settings
from random_workloads import TIER_KINDS, PromptSpec, Workload, workloads
from workload_runner import on_one_thread, run_workload

from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import StoreMode


def test_random_workloads_match_offload_off() -> None:
    """Same tokens through the tiers, for random workloads, with hits in every tier kind."""
    totals: Counter[str] = Counter()

    @settings(
        max_examples=120,
        deadline=None,
        derandomize=True,  # the same examples on every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads())
    def check(workload: Workload) -> None:
        run_workload(workload, totals)

    on_one_thread(check)
    assert totals["external_hit_tokens"] > 800, totals
    assert totals["cpu_hit_tokens"] > 0, totals
    assert totals["disk_hit_tokens"] > 0, totals
    for tier in TIER_KINDS:
        assert totals[f"examples_with_hits_{tier}"] > 0, (tier, totals)
    assert totals["examples_with_hits"] * 3 > totals["examples"], totals
    assert totals["preemptions"] > 0, totals
    assert totals["failed_loads"] > 0, totals
    assert totals["failed_stores"] > 0, totals
    assert totals["demoted_blocks"] > 0, totals


# Regression (found by the property above): lazy store selection walked the GPU free
# queue on idle steps too. With about 10 cached blocks there and a CPU tier of 4 slots (2
# of them pinned by write-through demotions), every idle step stored 2 blocks, evicting 2
# that a later step stored again: the copies never stopped, though no request was left.
# Each completed store queued a demotion to the 4-slot disk, so `has_pending_stores()`
# was True after every step and `LLM.drain()` (hence `shutdown()`, and leaving
# `with LLM(...)`) never returned. A synchronous worker made it deterministic; the real
# asynchronous one hung there too, some of the time.
LAZY_WRITE_THROUGH_IDLE_CHURN = Workload(
    model="hybrid",
    block_size=4,
    prefixes=((0,) * 15,),
    prompts=(
        PromptSpec(0, None, (), SamplingParams(max_tokens=7, ignore_eos=True)),
        PromptSpec(None, None, (0,), SamplingParams(max_tokens=6, ignore_eos=True)),
    ),
    batches=((0, 1),),
    gpu_slack_blocks=0,  # 13 GPU blocks: 2 groups x 6 + the null block
    rounds=1,
    max_num_batched_tokens=16,
    tier="write_through",
    cpu_blocks=5,
    disk_blocks=5,
    store_mode=StoreMode.LAZY,
    eviction_policy="lru",
    admission_policy="all",
    synchronous=True,
    fail_loads=False,
    fail_stores=False,
)


@settings(phases=[Phase.explicit], deadline=None, database=None)
@example(LAZY_WRITE_THROUGH_IDLE_CHURN)
@given(workloads())
def test_lazy_write_through_drains(workload: Workload) -> None:
    """Lazy stores into a tiny write-through cascade: `drain` returns (it used to spin)."""
    run_workload(workload, Counter(), max_steps=500)
