"""End-to-end: the reference engine with kvtier's tiers (SPEC scenarios 31 and 32)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.offload.plan import TransferPlan, WorkerReport

MIB = 1 << 20
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def chat_prompts(num_conversations: int, seed: int = 0) -> list[list[list[int]]]:
    """Return per turn the prompts of conversations sharing a system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(128) for _ in range(24)]
    turns = []
    histories = [list(system) for _ in range(num_conversations)]
    for _ in range(3):
        for history in histories:
            history.extend(rng.randrange(128) for _ in range(rng.randrange(5, 14)))
        turns.append([list(h) for h in histories])
    return turns


def serve(
    model: ModelConfig,
    offload: OffloadConfig | None,
    wrap: Callable[[Any], Any] | None = None,
    inspect: Callable[[LLM], None] | None = None,
) -> list[RequestOutput]:
    """Serve three turns of four conversations, feeding each answer into the history.

    The copies run synchronously (`Synchronous`, under `wrap`): whether the pool
    preempts follows them (a store still in flight pins its blocks, and a request short
    of blocks waits for it instead), so with the copy threads a slow store thread (2
    busy cores) left a run without preemptions."""
    engine = EngineConfig(
        block_size=4,
        # A sliding-window group gives back out-of-window blocks: it adds fewer.
        num_gpu_blocks=20 + 6 * (len(model.layer_groups()) - 1),
        max_num_batched_tokens=24,
        keep_logits=True,
    )
    outputs: list[RequestOutput] = []
    with LLM(model, kv_offload=offload, engine=engine) as llm:
        if llm.offload is not None:
            worker = Synchronous(llm.offload.worker)
            llm.offload.worker = worker if wrap is None else wrap(worker)
        answers: list[list[int]] = [[] for _ in range(4)]
        for prompts in chat_prompts(4):
            full = [p + a for p, a in zip(prompts, answers, strict=True)]
            results = llm.generate(full, PARAMS)
            for i, result in enumerate(results):
                answers[i] = answers[i] + list(result.output_token_ids)
            outputs.extend(results)
        assert llm.stats.num_preemptions > 0, "the tiny pool should force preemptions"
        if inspect is not None:
            llm.drain()
            inspect(llm)
    return outputs


def assert_same(reference: list[RequestOutput], other: list[RequestOutput]) -> None:
    """Check tokens are identical and logits equal within float32 noise."""
    for a, b in zip(reference, other, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.logits is not None
        assert b.logits is not None
        assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=0)


def tier_configs(tmp_path: Path) -> dict[str, OffloadConfig]:
    """Return the CPU tier and the disk tier (page cache: tmpfs may refuse O_DIRECT)."""
    disk = OffloadConfig(
        disk_bytes=8 * MIB,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
    )
    return {"cpu": OffloadConfig(cpu_bytes=8 * MIB), "disk": disk}


@pytest.mark.parametrize(
    "model", [ModelConfig.tiny(), ModelConfig.tiny_hybrid()], ids=["full", "hybrid"]
)
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_outputs_identical_through_tiers(model: ModelConfig, tier: str, tmp_path: Path) -> None:
    """Scenario 31: greedy tokens and logits match offload off, with tier hits and preemptions."""
    reference = serve(model, None)
    through_tier = serve(model, tier_configs(tmp_path)[tier])
    assert sum(o.num_external_hit_tokens for o in through_tier) > 0, "the tier was never hit"
    assert_same(reference, through_tier)


@pytest.mark.parametrize(
    "model", [ModelConfig.tiny(), ModelConfig.tiny_hybrid()], ids=["full", "hybrid"]
)
@pytest.mark.parametrize("mode", list(CascadeMode), ids=lambda m: m.value)
def test_outputs_identical_through_the_cascade(
    model: ModelConfig, mode: CascadeMode, tmp_path: Path
) -> None:
    """Scenario 31 over CPU+disk: a small CPU tier demotes to disk; disk hits serve too."""
    bytes_per_block = 2048  # the tiny models, both layouts (checked below)
    cascade = OffloadConfig(
        cpu_bytes=20 * bytes_per_block,
        disk_bytes=8 * MIB,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        cascade=mode,
    )
    totals: dict[str, int] = {}
    moved: dict[str, tuple[int, float]] = {}

    def inspect(llm: LLM) -> None:
        assert llm.offload is not None
        assert llm.layout.bytes_per_block == bytes_per_block
        totals.update(llm.offload.totals.hit_tokens)
        totals["demoted"] = llm.offload.totals.num_demoted_blocks
        totals["promoted"] = llm.offload.totals.num_promoted_blocks
        seconds = llm.offload.totals.transfer_seconds
        moved.update((k, (v, seconds[k])) for k, v in llm.offload.totals.transfer_bytes.items())

    reference = serve(model, None)
    # Finishing every copy within its step makes which tier serves what deterministic.
    through = serve(model, cascade, inspect=inspect)
    assert totals["CPU"] > 0, totals
    assert totals["DISK"] > 0, totals
    assert totals["demoted"] > 0, totals
    assert totals["promoted"] > 0, totals
    # SPEC §6.10 Beyond: bytes and copy time per direction, every direction taken.
    assert set(moved) == {"GPU_to_CPU", "CPU_to_GPU", "CPU_to_DISK", "DISK_to_GPU"}, moved
    assert moved["CPU_to_DISK"][0] == totals["demoted"] * bytes_per_block
    assert all(num_bytes > 0 and seconds > 0 for num_bytes, seconds in moved.values()), moved
    assert_same(reference, through)


class Synchronous:
    """Wrap a worker so that every plan's copies finish before the step goes on."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def submit(self, plan: TransferPlan) -> None:
        self.worker.submit(plan)
        self.worker.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class FailingLoads:
    """Wrap a worker so that every load it finishes is reported as failed."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.load_events: set[int] = set()

    def submit(self, plan: TransferPlan) -> None:
        self.load_events.update(j.event_id for j in plan.jobs if j.is_load)
        self.worker.submit(plan)

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        done = {e: n for e, n in report.done.items() if e not in self.load_events}
        failed = dict(report.failed)
        failed.update({e: n for e, n in report.done.items() if e in self.load_events})
        return WorkerReport(done=done, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_failed_loads_are_recomputed() -> None:
    """A worker whose every load fails still yields identical tokens (recompute path)."""
    reference = serve(ModelConfig.tiny(), None)
    failing = serve(ModelConfig.tiny(), OffloadConfig(cpu_bytes=8 * MIB), wrap=FailingLoads)
    assert sum(o.num_external_hit_tokens for o in failing) == 0
    assert_same(reference, failing)


class DoneAndFailed:
    """Wrap a worker so that every event it finishes is reported both done and failed
    (as two reports of one event would be: it completes as failed)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        failed = {**report.failed, **report.done}
        return WorkerReport(done=report.done, failed=failed, seconds=report.seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_an_event_reported_both_done_and_failed_counts_once() -> None:
    # Regression: `num_reported_events` (the drain's progress mark) counted it twice.
    def counts_each_event_once(llm: LLM) -> None:
        assert llm.offload is not None
        totals = llm.offload.totals
        assert totals.num_issued_events > 0
        assert totals.num_failed_stores > 0
        assert totals.num_reported_events == totals.num_issued_events

    reference = serve(ModelConfig.tiny(), None)
    offload = OffloadConfig(cpu_bytes=8 * MIB)
    served = serve(ModelConfig.tiny(), offload, DoneAndFailed, counts_each_event_once)
    assert sum(o.num_external_hit_tokens for o in served) == 0  # every store failed
    assert_same(reference, served)


def computed_tokens(llm: LLM, prompt: list[int]) -> tuple[RequestOutput, int]:
    """Serve `prompt` alone; return its output and the tokens the forward passes computed."""
    counted: list[int] = []
    run = llm.runner.run

    def counting(batch: Any, *args: Any, **kwargs: Any) -> Any:
        counted.append(sum(len(s.token_ids) for s in batch.sequences))
        return run(batch, *args, **kwargs)

    llm.runner.run = counting  # type: ignore[method-assign]
    try:
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    finally:
        llm.runner.run = run  # type: ignore[method-assign]
    return output, sum(counted)


def test_a_tier_hit_skips_recomputing_the_evicted_prefix() -> None:
    """SPEC scenario 32's mechanism (its time is measured by `make demo`, not asserted
    here): a prompt whose prefix left the GPU but stayed in the CPU tier computes only
    the tokens after the tier hit; without the tier it computes them all."""
    rng = random.Random(3)
    prompt = [rng.randrange(128) for _ in range(64)]
    fillers = [[rng.randrange(128) for _ in range(40)] for _ in range(4)]
    again = [*prompt, 7]
    counts = {}
    for name, offload in (("off", None), ("cpu", OffloadConfig(cpu_bytes=8 * MIB))):
        engine = EngineConfig(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=32)
        with LLM(ModelConfig.tiny(), kv_offload=offload, engine=engine) as llm:
            llm.generate([prompt], PARAMS)
            llm.generate(fillers, PARAMS)  # the pool's 24 blocks: the prompt's 16 are evicted
            llm.drain()
            output, counts[name] = computed_tokens(llm, again)
            assert output.num_local_hit_tokens == 0, name
            counts[name + " hit"] = output.num_external_hit_tokens
    assert counts["off hit"] == 0
    assert counts["cpu hit"] == 64
    assert counts["off"] == len(again) + 1  # the prompt, then one decode step
    assert counts["cpu"] == counts["off"] - counts["cpu hit"]


def test_hit_tokens_of_a_request_never_exceed_its_prompt() -> None:
    """Regression: a request's hits were added up over its admissions. Two prompts back
    from a load whose blocks were released (for a request that must grow) loaded their
    12-token prefixes again: each 13-token prompt reported 24 tier-hit tokens."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=9, max_num_seqs=1, max_num_batched_tokens=3)
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine)
    assert llm.offload is not None
    # Copies finished within their step: which requests hold loaded blocks when the
    # third must grow then does not depend on when the copy threads ran (a load
    # reported a step late left none to release: "no request was admitted twice").
    llm.offload.worker = Synchronous(llm.offload.worker)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    first, second = list(range(12)), list(range(50, 62))
    llm.generate([first, second], one)  # stored in the tier as they finish
    llm.generate([list(range(70, 102))], one)  # 8 blocks: evicts both from the GPU
    llm.drain()
    releases = llm.stats.num_idle_releases
    prompts = [[*first, 1], [*second, 2], list(range(20, 40))]
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 2
    outputs = llm.generate(prompts, [*params, SamplingParams(max_tokens=9, ignore_eos=True)])
    assert llm.stats.num_idle_releases > releases, "no request was admitted twice"
    assert [o.num_external_hit_tokens for o in outputs] == [12, 12, 0]
    assert llm.stats.num_external_hit_tokens == 24
    llm.shutdown()
