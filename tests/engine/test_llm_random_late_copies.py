"""Property: with copies that start late (`late_copies`), aborts aimed at requests whose
load is in flight, preemptions in GPU pools sized to the longest request's peak, and a
reset plus a weight update while copies are still unstarted, every finished request has
the tokens (and logits within 1e-4) of an engine with offload off.

A copy that lands late exposes what a worker copying at once hides: a GPU block freed
before its load or store really ran (another request computes into it), or a stored
block of before a reset registered after it (the old weights' KV served after the
update). The step API is used so aborts can land between steps.
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from late_copies import LateCopies
from random_workloads import MODELS, TIER_KINDS, VOCAB, WORKLOAD_SETTINGS
from step_watchdog import with_watchdog
from workload_runner import kv_group_spec, on_one_thread

from kvtier.core.kv_groups import KVLayout
from kvtier.core.policies import EVICTION_POLICIES
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.validation import num_peak_blocks
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig, StoreMode

MAX_PROMPT = 40
MAX_TOKENS = 6
MAX_STEPS = 3000


def offload_config(
    tier: str, num_blocks: int, bytes_per_block: int, path: str, **kw: Any
) -> OffloadConfig:
    """Return the tier `tier` with `num_blocks` CPU blocks (twice as many on disk)."""
    sizes: dict[str, Any] = {
        "cpu": {"cpu_bytes": num_blocks * bytes_per_block},
        "disk": {"disk_bytes": num_blocks * bytes_per_block, "disk_path": path},
        "write_through": {
            "cpu_bytes": num_blocks * bytes_per_block,
            "disk_bytes": 2 * num_blocks * bytes_per_block,
            "disk_path": path,
        },
        "write_back": {
            "cpu_bytes": num_blocks * bytes_per_block,
            "disk_bytes": 2 * num_blocks * bytes_per_block,
            "disk_path": path,
            "cascade": CascadeMode.WRITE_BACK,
        },
    }[tier]
    if "disk_path" in sizes:
        sizes["disk_io_mode"] = DiskIOMode.PAGE_CACHE  # tmpfs may refuse O_DIRECT
    return OffloadConfig(**sizes, **kw)


def perturb(llm: LLM, seed: int) -> None:
    """Update the weights in memory (the same update for every engine given `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in llm.runner.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)


class Run:
    """One example: the engine under test, the reference, and the running counters."""

    def __init__(self, llm: LLM, reference: LLM, late: LateCopies, rng: random.Random) -> None:
        self.llm, self.reference, self.late, self.rng = llm, reference, late, rng
        self.live: dict[str, tuple[Request, list[int], SamplingParams]] = {}
        self.finished: list[list[int]] = []
        self.counts: Counter[str] = Counter()
        self.arm = with_watchdog(llm, MAX_STEPS)

    def prompt(self, prefixes: list[list[int]]) -> list[int]:
        rng = self.rng
        if self.finished and rng.random() < 0.5:
            head = rng.choice(self.finished)
        else:
            head = rng.choice(prefixes)
        head = head[: rng.randint(max(1, len(head) // 2), len(head))]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        return (head + tail)[:MAX_PROMPT]

    def add(self, prefixes: list[list[int]], num: int) -> None:
        for _ in range(num):
            prompt = self.prompt(prefixes)
            params = SamplingParams(max_tokens=self.rng.randint(1, MAX_TOKENS), ignore_eos=True)
            request = self.llm.add_request(prompt, params)
            self.live[request.request_id] = (request, prompt, params)

    def step(self) -> None:
        for request in self.llm.step():
            _, prompt, params = self.live.pop(request.request_id)
            (want,) = self.reference.generate([prompt], params)
            assert tuple(request.output_token_ids) == want.output_token_ids, (
                f"{request.request_id}: {request.output_token_ids} != {want.output_token_ids}"
            )
            assert want.logits is not None
            assert torch.allclose(torch.stack(request.kept_logits), want.logits, atol=1e-4)
            self.counts["external_hit_tokens"] += request.num_external_tokens_total
            self.finished.append(prompt + request.output_token_ids)

    def abort_a_loading_request(self) -> None:
        loading = [
            r for r, _, _ in self.live.values() if r.status is RequestStatus.WAITING_FOR_LOAD
        ]
        if loading:
            request = self.rng.choice(loading)
            self.counts["aborted_loading_unstarted"] += self.late.num_unstarted("load") > 0
            self.llm.abort_request(request)
            del self.live[request.request_id]

    def serve(self, abort_p: float) -> None:
        self.arm()
        while self.live:
            self.step()
            if self.rng.random() < abort_p:
                self.abort_a_loading_request()

    def abort_all_reset_update(self, seed: int) -> None:
        """Abort everything after a few steps, reset and update the weights at once."""
        self.arm()
        for _ in range(self.rng.randint(0, 12)):
            self.step()
        for request, _, _ in self.live.values():
            self.llm.abort_request(request)
        self.live.clear()
        self.counts["reset_unstarted_stores"] += self.late.num_unstarted("store") > 0
        self.counts["reset_unstarted_loads"] += self.late.num_unstarted("load") > 0
        self.llm.reset_prefix_cache()  # False while copies are outstanding: served none
        assert self.reference.reset_prefix_cache()
        perturb(self.llm, seed)
        perturb(self.reference, seed)


@st.composite
def examples(draw: st.DrawFn) -> dict[str, Any]:
    """Draw a model, tier, pool slack, limits and how late each lane's copies start."""
    return {
        "model": draw(st.sampled_from(sorted(MODELS))),
        "block_size": draw(st.sampled_from([2, 4])),
        "tier": draw(st.sampled_from(TIER_KINDS)),
        "tier_blocks": draw(st.integers(16, 64)),
        "store_mode": draw(st.sampled_from(list(StoreMode))),
        "eviction": draw(st.sampled_from(list(EVICTION_POLICIES))),
        "slack": draw(st.integers(0, 2)),
        "max_seqs": draw(st.integers(2, 6)),
        "budget": draw(st.sampled_from([8, 16, 64])),
        "p_release": {
            "load": draw(st.sampled_from([0.1, 0.3, 1.0])),
            "store": draw(st.sampled_from([0.2, 0.5, 1.0])),
        },
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def run_example(ex: dict[str, Any], totals: Counter[str]) -> None:
    """Serve four rounds of 2-6 requests (one round aborted, then reset and an update)."""
    model = MODELS[ex["model"]]
    rng = random.Random(ex["seed"])
    block_size = ex["block_size"]
    specs = tuple(kv_group_spec(g, block_size) for g in model.layer_groups())
    peak = num_peak_blocks(KVLayout(specs), MAX_PROMPT + MAX_TOKENS - 1)
    engine = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=peak + 1 + ex["slack"],
        max_num_seqs=ex["max_seqs"],
        max_num_batched_tokens=ex["budget"],
        keep_logits=True,
    )
    prefixes: list[list[int]] = []
    for _ in range(3):
        parent = rng.choice([[], *prefixes])
        prefixes.append((parent + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 24))])[:36])
    bytes_per_block = model.kv_bytes_per_token() * block_size
    with tempfile.TemporaryDirectory(prefix="kvtier-late-") as path:
        config = offload_config(
            ex["tier"],
            ex["tier_blocks"],
            bytes_per_block,
            path,
            store_mode=ex["store_mode"],
            eviction_policy=ex["eviction"],
            max_batched_tokens=ex["budget"],
        )
        with LLM(model, engine=EngineConfig(block_size=block_size, keep_logits=True)) as ref:
            llm = LLM(model, config, engine)
            assert llm.offload is not None
            try:
                late = LateCopies(llm.offload.worker, random.Random(rng.random()), ex["p_release"])
                llm.offload.worker = late
                run = Run(llm, ref, late, rng)
                reset_round = rng.randrange(3)
                for round_index in range(4):
                    for block_id in range(1, llm.pool.num_blocks):  # hits come from the tier
                        if llm.pool.is_cached(block_id) and llm.pool.ref_count(block_id) == 0:
                            llm.pool.evict_keys(block_id)
                    run.add(prefixes, rng.randint(2, 6))
                    if round_index == reset_round:
                        run.abort_all_reset_update(rng.randrange(2**30))
                    else:
                        run.serve(abort_p=0.2)
                run.arm()
                llm.drain()
                llm.offload.scheduler.check_invariants()
                totals.update(run.counts)
                totals["preemptions"] += llm.stats.num_preemptions
            finally:
                llm.offload.shutdown()


def test_late_copies_aborts_and_resets_match_offload_off() -> None:
    totals: Counter[str] = Counter()

    @settings(max_examples=25, **WORKLOAD_SETTINGS)
    @given(examples())
    def check(ex: dict[str, Any]) -> None:
        run_example(ex, totals)

    on_one_thread(check)
    for name in ("external_hit_tokens", "preemptions", "aborted_loading_unstarted",
                 "reset_unstarted_stores"):  # fmt: skip
        assert totals[name] > 0, totals
