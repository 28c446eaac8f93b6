"""EAGLE-style speculative decoding: a tier hit ends where vLLM's own hits end.

Such a drafter builds a position's draft KV from its hidden state and the next token, so
vLLM ends a prefix hit one block before the last block it matched
(`use_eagle_block_drop`): the matched block proves that the token after the hit is the
one the stored draft KV saw. kvtier's hits need that proof too (`eagle_proof` of
`core.longest_hit`). With a Mamba group vLLM keeps the state where such a hit ends,
one block before the prompt's last whole block; the harness's `eagle` runs vLLM's
scheduler with an EAGLE speculative config, so its states are kept where a real EAGLE
engine keeps them (no drafter runs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from gpu_eviction import evict_from_gpu
from kvtier_vllm import check_quiescent, kvtier_harness, scheduler_side
from random_ops import Engine
from test_vllm_random_ops import explore
from vllm_engine import KVGroupDef
from vllm_harness import (
    SIMPLE_CPU_OFFLOAD,
    HarnessConfig,
    VllmHarness,
    shared_prefix_prompts,
    simple_offload_worker_factory,
)

from kvtier.adapters.vllm.scheduler_side import SchedulerSide

HYBRID = (KVGroupDef(16), KVGroupDef(16, mamba=True))
# Full attention in blocks of 32 beside an 8-token window in blocks of 16.
SMALL_WINDOW = (KVGroupDef(32), KVGroupDef(16, 8))
Prompts = dict[str, list[int]]


def shared_prefix() -> tuple[Prompts, Prompts]:
    """64-token prefixes, then other suffixes: only the prefix can come from a cache."""
    first = shared_prefix_prompts(4, prefix_len=64, suffix_len=7, num_prefixes=2)
    again = {
        f"again-{r}": [*p[:64], *shared_prefix_prompts(1, 0, 9, seed=i)["req-0"]]
        for i, (r, p) in enumerate(first.items())
    }
    return first, again


def resend(num_tokens: int) -> Callable[[], tuple[Prompts, Prompts]]:
    def prompts() -> tuple[Prompts, Prompts]:
        first = shared_prefix_prompts(4, prefix_len=0, suffix_len=num_tokens, seed=3)
        return first, {f"again-{r}": list(p) for r, p in first.items()}

    return prompts


def extended() -> tuple[Prompts, Prompts]:
    """A 64-token prompt continued by 20 more tokens (a next turn)."""
    first = shared_prefix_prompts(4, prefix_len=0, suffix_len=64, seed=3)
    return first, {f"again-{r}": [*p, *range(500, 520)] for r, p in first.items()}


def tier_hits(harness: VllmHarness, workload: Callable[[], tuple[Prompts, Prompts]]) -> list[int]:
    """Run the workload's first prompts, evict them from the GPU with fillers, run
    the second prompts; return their external hit tokens (the harness checks every
    loaded position and every state a forward starts from)."""
    first, again = workload()
    try:
        harness.run_requests(first, max_tokens=4)
        evict_from_gpu(harness, first)
        harness.run_requests(again, max_tokens=4)
        assert all(harness.local_hit_tokens(r) == 0 for r in again)
        return [harness.external_hit_tokens(r) for r in again]
    finally:
        harness.close()


def simple_offload(**overrides: object) -> VllmHarness:
    """vLLM's own CPU offload connector on the same engine, 256 CPU blocks."""
    extra = {"cpu_bytes_to_use": 256 * 2 * 2048 * 2}
    cfg = HarnessConfig(connector=SIMPLE_CPU_OFFLOAD, extra_config=extra, **overrides)  # type: ignore[arg-type]
    return VllmHarness(cfg, simple_offload_worker_factory())


@pytest.mark.parametrize("drafter", [True, False], ids=["eagle", "no-drop"])
def test_the_speculative_config_decides_the_proof(drafter: bool) -> None:
    harness = kvtier_harness()
    try:
        side = scheduler_side(harness)
        vllm_config = copy.copy(harness.vllm_config)
        spec = SimpleNamespace(use_eagle_block_drop=lambda: drafter)
        object.__setattr__(vllm_config, "speculative_config", spec)
        eagle = SchedulerSide(vllm_config, harness.kv_cache_config, side.offload.config, [2])
        assert eagle.offload.loads.eagle_proof is drafter
        assert not side.offload.loads.eagle_proof
    finally:
        harness.close()


def test_an_eagle_engine_loads_all_but_the_last_block_of_the_tier_hit() -> None:
    harness = kvtier_harness(eagle=True)
    prompts = shared_prefix_prompts(4, prefix_len=48, suffix_len=5, num_prefixes=4)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()  # the GPU copies only
    again = {f"again-{r}": [*p, 9] for r, p in prompts.items()}
    harness.run_requests(again, max_tokens=3)  # the harness checks every loaded position
    # 48 prefix tokens (3 blocks) in the tier, the 4th block never full: no proof for 48.
    assert all(harness.external_hit_tokens(r) == 32 for r in again)
    check_quiescent(harness)
    harness.close()


@pytest.mark.parametrize(
    "workload", [shared_prefix, resend(70), extended], ids=["shared", "resend70", "extended"]
)
def test_a_mamba_hybrid_under_eagle_hits_as_much_as_vllms_offload_connector(
    workload: Callable[[], tuple[Prompts, Prompts]],
) -> None:
    """Regression: kvtier cut its longest hit (48, ending at the state vLLM keeps for an
    EAGLE engine) short by a block, to 32 where no state was kept: 0 or 32 tokens per
    request where vLLM's offload connector loads 48."""
    hits = tier_hits(kvtier_harness(eagle=True, kv_groups=HYBRID, num_gpu_blocks=24), workload)
    vllms = tier_hits(simple_offload(eagle=True, kv_groups=HYBRID, num_gpu_blocks=24), workload)
    assert hits == vllms == [48] * 4


@pytest.mark.parametrize("workload", [shared_prefix, resend(70)], ids=["shared", "resend70"])
def test_a_window_in_blocks_smaller_than_the_scheduler_block_hits_as_vllm_does(
    workload: Callable[[], tuple[Prompts, Prompts]],
) -> None:
    """Regression: kvtier's proof was a scheduler block (32 tokens) in every group; vLLM
    keeps a window's blocks for an EAGLE hit only up to its own block after the hit, so
    kvtier hit 0 tokens where vLLM's offload connector loads 32."""
    hits = tier_hits(
        kvtier_harness(eagle=True, kv_groups=SMALL_WINDOW, num_gpu_blocks=24), workload
    )
    vllms = tier_hits(
        simple_offload(eagle=True, kv_groups=SMALL_WINDOW, num_gpu_blocks=24), workload
    )
    assert hits == vllms == [32] * 4


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "mamba"])
def test_a_resent_block_aligned_prompt_hits_up_to_its_proof(hybrid: bool) -> None:
    """A resent 64-token prompt: the last token is recomputed (cap 63), so the hit ends
    at 48, with the 4th block (in the tier) as its proof; vLLM's offload connector loads
    48 for the hybrid, and 32 for attention only (it drops a block after capping)."""
    groups = HYBRID if hybrid else ()
    hits = tier_hits(kvtier_harness(eagle=True, kv_groups=groups, num_gpu_blocks=24), resend(64))
    assert hits == [48] * 4


@pytest.mark.parametrize(
    "engine",
    [
        Engine("eagle_full", eagle=True),
        Engine("eagle_mamba", kv_groups=HYBRID, num_gpu_blocks=16, eagle=True),
        Engine("eagle_window", kv_groups=(KVGroupDef(16), KVGroupDef(16, 32)), eagle=True),
        Engine("eagle_small_window", kv_groups=SMALL_WINDOW, num_gpu_blocks=24, eagle=True),
        # A fake drafter's tokens, some rejected: their positions hold KV of other prefixes.
        Engine("eagle_drafts", eagle=True, drafts=3),
        # Under overlapped asynchronous scheduling: placeholders the runner fills.
        Engine("eagle_async_drafts", async_batches=2, eagle=True, drafts=3),
        Engine(
            "lazy_small_window_drafts",
            "lazy",
            kv_groups=SMALL_WINDOW,
            num_gpu_blocks=24,
            eagle=True,
            drafts=2,
        ),
    ],
    ids=lambda engine: engine.name,
)
def test_random_operations_under_eagle_serve_correct_kv(engine: Engine) -> None:
    """test_vllm_random_ops's operations with vLLM running EAGLE's cache rules: every
    loaded position and state is checked, every tier block audited, every prompt
    replayed (without `drafts`, the fake runner rejects the drafts vLLM schedules)."""
    totals = explore(engine, 12)
    assert totals["audited_tier_blocks"] > 0
    assert totals["replay_hit_tokens"] > 0
    assert totals["preemptions"] > 0
    assert totals["failed_load"] > 0
    if engine.drafts:
        assert totals["drafted"] > totals["accepted"] > 0
