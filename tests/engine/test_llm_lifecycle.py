"""The engine's life around failures: stalls, failed steps and shutdown.

Regressions: with offload on, a request that could never be scheduled made `generate`
spin forever; a request failing inside a step stayed queued and failed every later call;
after `shutdown()` the engine kept serving (offload off) or failed deep in the worker.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from step_watchdog import with_watchdog

from kvtier.engine import validation
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import RequestStatus
from kvtier.engine.runner import BatchInput
from kvtier.engine.sampling import FinishReason, SamplingParams
from kvtier.offload.config import DiskIOMode, OffloadConfig, StoreMode
from kvtier.offload.plan import WorkerReport

MIB = 1 << 20
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
OFFLOADS: dict[str, OffloadConfig | None] = {
    "off": None,
    "eager": OffloadConfig(cpu_bytes=4 * MIB),
    "lazy": OffloadConfig(cpu_bytes=4 * MIB, store_mode=StoreMode.LAZY),
}


def fresh_outputs(
    model: ModelConfig | None, engine: EngineConfig, prompts: list[list[int]]
) -> list[tuple[int, ...]]:
    """Return the tokens an engine without offloading produces for `prompts`."""
    return [o.output_token_ids for o in LLM(model, engine=engine).generate(prompts, PARAMS)]


def assert_idle(llm: LLM) -> None:
    """Check no request is left and, once transfers drained, every GPU block is free."""
    assert not llm.scheduler.has_unfinished()
    llm.drain()
    for _ in range(2000):  # aborted loads still in flight release their pins when done
        if llm.pool.num_free() == llm.pool.num_usable_blocks:
            break
        llm.step()
    assert llm.pool.num_free() == llm.pool.num_usable_blocks
    llm.pool.check_invariants()
    if llm.offload is not None:
        llm.offload.scheduler.check_invariants()


# ---------------------------------------------------------------- stalls


@pytest.mark.parametrize("offload", list(OFFLOADS), ids=str)
def test_a_request_that_never_fits_raises_instead_of_hanging(
    offload: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that needs 8 blocks at one position (18: window 11..18 spans blocks
    2..4, with 5 full-attention blocks) and 7 in the pool. The up-front check refuses it;
    bypassed (it counted the last position only, 7 blocks, before), the step raises
    instead of spinning: it used to spin with offload on."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=8)
    model = ModelConfig.tiny_hybrid()
    llm = LLM(model, kv_offload=OFFLOADS[offload], engine=engine)
    arm = with_watchdog(llm, 500)  # a hang fails the test instead of blocking pytest
    arm()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with pytest.raises(ValueError, match="needs at least 8 KV blocks at one step"):
        llm.generate([list(range(20))], params)
    monkeypatch.setattr(validation, "num_peak_blocks", lambda layout, num_tokens: 0)
    with pytest.raises(RuntimeError, match=r"no progress possible: req-1 \(20 tokens\).*aborted"):
        llm.generate([[1, 2, 3], list(range(20))], params)
    assert_idle(llm)
    # Stepped, not generated: the step itself aborts it, so the next step runs on.
    # Mutation: the step raised without aborting it (the engine kept it unfinished).
    stuck = llm.add_request(list(range(20)), params)
    with pytest.raises(RuntimeError, match=r"no progress possible: req-2 .*aborted"):
        llm.step()
    assert (stuck.status, stuck.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    assert_idle(llm)
    arm()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    outputs = [o.output_token_ids for o in llm.generate(prompts, PARAMS)]
    assert outputs == fresh_outputs(model, engine, prompts)
    llm.shutdown()


class DelayedReports:
    """Wrap a worker: report completions only every `num_polls`-th poll."""

    def __init__(self, worker: Any, num_polls: int) -> None:
        self.worker = worker
        self.num_polls = num_polls
        self.num_calls = 0
        self.done: Counter[int] = Counter()
        self.failed: Counter[int] = Counter()

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        self.done.update(report.done)
        self.failed.update(report.failed)
        self.num_calls += 1
        if self.num_calls % self.num_polls:
            return WorkerReport()
        done, failed = dict(self.done), dict(self.failed)
        self.done.clear()
        self.failed.clear()
        return WorkerReport(done=done, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_waiting_for_stores_that_pin_gpu_blocks_is_not_a_stall() -> None:
    """The finish-time stores of A pin 2 of 4 GPU blocks; B needs all 4 and must wait."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=5)
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine)
    assert llm.offload is not None
    llm.offload.worker = DelayedReports(llm.offload.worker, num_polls=40)
    llm.generate([list(range(8))], SamplingParams(max_tokens=1, ignore_eos=True))
    assert llm.pool.num_free() == 2, "A's stores should pin its 2 full blocks"
    steps_before = llm.stats.num_steps
    prompt = list(range(100, 113))
    (output,) = llm.generate([prompt], PARAMS)
    assert llm.stats.num_steps - steps_before > 20, "B should have waited for the stores"
    assert [output.output_token_ids] == fresh_outputs(None, engine, [prompt])
    llm.shutdown()


# ---------------------------------------------------------------- failed steps


def failing_forward(llm: LLM, fail_on_call: int) -> Callable[[], int]:
    """Make the `fail_on_call`-th forward pass raise; return a counter of forward calls."""
    run = llm.runner.run
    calls = [0]

    def flaky(batch: BatchInput, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == fail_on_call:
            raise RuntimeError("injected forward failure")
        return run(batch, *args)

    llm.runner.run = flaky  # type: ignore[method-assign]
    return lambda: calls[0]


def chat_prompts(num: int, length: int, offset: int = 0) -> list[list[int]]:
    """Return `num` distinct prompts of `length` tokens."""
    return [[(offset + 7 * i + j) % 128 for j in range(length)] for i in range(num)]


@pytest.mark.parametrize("offload", list(OFFLOADS), ids=str)
def test_a_failed_step_aborts_the_call_and_leaves_the_engine_usable(offload: str) -> None:
    """Requests of a failed call used to stay queued (and re-fail every later call)."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=24)
    llm = LLM(None, kv_offload=OFFLOADS[offload], engine=engine)
    first = chat_prompts(4, 24)
    second = [[*p, 1, 2, 3, 4] for p in first]  # tier hits: loads in flight at the failure
    llm.generate(first, PARAMS)
    num_calls = failing_forward(llm, fail_on_call=1)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(second, PARAMS)
    assert num_calls() == 1
    assert_idle(llm)
    outputs = [o.output_token_ids for o in llm.generate(second, PARAMS)]
    assert outputs == fresh_outputs(None, engine, second)
    assert_idle(llm)
    llm.shutdown()


def test_a_failure_mid_decode_frees_the_blocks_of_every_request_of_the_call() -> None:
    engine = EngineConfig(block_size=4, num_gpu_blocks=32)
    llm = LLM(None, engine=engine)
    failing_forward(llm, fail_on_call=3)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(chat_prompts(3, 9), SamplingParams(max_tokens=8, ignore_eos=True))
    assert_idle(llm)


def test_a_failed_step_aborts_its_stepped_requests() -> None:
    """Requests queued by `add_request` are the failed step's to abort (no `generate`
    call owns them). Mutation: the step re-raised without aborting them: they stayed
    RUNNING, holding their blocks."""
    llm = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=32))
    requests = [llm.add_request(p, PARAMS) for p in chat_prompts(2, 9)]
    failing_forward(llm, fail_on_call=1)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.step()
    assert [r.finish_reason for r in requests] == [FinishReason.ABORT] * 2
    assert_idle(llm)


def test_requests_a_failed_step_finished_are_not_returned_by_a_later_step() -> None:
    """A call's request finished by the step that then failed (its poll raised: a disk
    manifest that cannot be written) was kept as unreturned: every later `generate`
    handed it on, and a later `step` returned it, though it was no `add_request`'s."""
    llm = LLM(None, OFFLOADS["eager"], EngineConfig(block_size=4, num_gpu_blocks=32))
    assert llm.offload is not None
    poll = llm.offload.poll

    def failing_poll() -> Any:
        llm.offload.poll = poll  # type: ignore[method-assign, union-attr]
        raise OSError("injected poll failure")

    llm.offload.poll = failing_poll  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected poll failure"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert llm.generate([[4, 5, 6]], SamplingParams(max_tokens=1))[0].request_id == "req-1"
    stepped = llm.add_request([7, 8, 9], SamplingParams(max_tokens=1))
    assert llm.step() == [stepped]
    assert llm.scheduler.unreturned == []
    assert_idle(llm)
    llm.shutdown()


# ---------------------------------------------------------------- shutdown


@pytest.mark.parametrize("offload", list(OFFLOADS), ids=str)
def test_a_shut_down_engine_refuses_work(offload: str) -> None:
    llm = LLM(None, kv_offload=OFFLOADS[offload], engine=EngineConfig(block_size=4))
    llm.generate([[1, 2, 3]], PARAMS)
    llm.shutdown()
    llm.shutdown()  # idempotent
    message = r"LLM is shut down \(shutdown\(\) was called or its `with` block ended\)"
    with pytest.raises(RuntimeError, match=message):
        llm.generate([[1, 2, 3]], PARAMS)
    with pytest.raises(RuntimeError, match=message):
        llm.add_request([1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match=message):
        llm.step()
    with LLM(None, kv_offload=OFFLOADS[offload], engine=EngineConfig(block_size=4)) as other:
        pass
    with pytest.raises(RuntimeError, match=message):
        other.generate([[1, 2, 3]], PARAMS)


# ---------------------------------------------------------------- loaded requests


def test_requests_back_from_a_load_give_their_blocks_to_a_request_that_must_grow() -> None:
    """Regression: A' and B' load 3 blocks each from the tier while Q runs (max_num_seqs=1
    keeps them waiting). Q then needs 7 of the 8 blocks: it preempted itself, was admitted
    again with its first chunk, and so on forever; `generate` never returned."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=9, max_num_seqs=1, max_num_batched_tokens=3)
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine)
    arm = with_watchdog(llm, 2000)
    arm()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    first, second = list(range(12)), list(range(50, 62))
    llm.generate([first, second], one)  # stored in the tier when they finish
    llm.generate([list(range(70, 102))], one)  # 8 blocks: evicts both from the GPU
    llm.drain()
    prompts = [[*first, 1], [*second, 2], list(range(20, 40))]
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=9, ignore_eos=True)
    ]
    arm()
    outputs = llm.generate(prompts, params)
    assert [o.num_external_hit_tokens > 0 for o in outputs[:2]] == [True, True]
    reference = LLM(None, engine=engine).generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in reference]
    assert_idle(llm)
    llm.shutdown()


def test_kept_logits_of_stepped_requests_are_theirs_and_go_with_them() -> None:
    """With `keep_logits`, requests run by `add_request` + `step` hold their own logits.

    One row per output token, equal to what `generate` returns for the same prompt; the
    engine keeps no reference, so a dropped request's logits are freed (they used to
    stay in the engine forever, out of the user's reach).
    """
    engine = EngineConfig(num_gpu_blocks=16, block_size=4, keep_logits=True)
    llm = LLM(None, engine=engine)
    prompts = chat_prompts(2, 9)
    expected = [o.logits for o in LLM(None, engine=engine).generate(prompts, PARAMS)]
    requests = [llm.add_request(prompt, PARAMS) for prompt in prompts]
    while llm.scheduler.has_unfinished():
        llm.step()
    for request, logits in zip(requests, expected, strict=True):
        assert logits is not None
        assert len(request.kept_logits) == len(request.output_token_ids)
        assert torch.equal(torch.stack(request.kept_logits), logits)
    rows = [weakref.ref(row) for request in requests for row in request.kept_logits]
    del requests, request
    gc.collect()
    assert all(row() is None for row in rows)


def test_engine_hit_counters_count_stepped_requests_as_generated_ones() -> None:
    """`EngineStats` hit tokens count requests finished by `step` as well as `generate`.

    The same shared-prefix prompt runs twice on each engine, the second time hitting
    the first's GPU blocks; `add_request` + `step` used to count no hit at all.
    """
    prompts = [[*range(12), 40], [*range(12), 41]]
    engine = EngineConfig(num_gpu_blocks=16, block_size=4)
    generated = LLM(None, engine=engine)
    outputs = [generated.generate([prompt], PARAMS)[0] for prompt in prompts]
    stepped = LLM(None, engine=engine)
    for prompt in prompts:
        stepped.add_request(prompt, PARAMS)
        while stepped.scheduler.has_unfinished():
            stepped.step()
    assert outputs[1].num_local_hit_tokens == 12
    assert stepped.stats.num_local_hit_tokens == generated.stats.num_local_hit_tokens == 12


def test_generate_leaves_stepped_requests_it_finished_for_the_next_step() -> None:
    """A request queued by `add_request` and finished inside a `generate` call is
    returned by the next `step` (it used to be dropped: `step` never reported it)."""
    llm = LLM(None, engine=EngineConfig(num_gpu_blocks=32, block_size=4))
    stepped = llm.add_request([*range(9)], PARAMS)
    (output,) = llm.generate([[*range(20, 40)]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert stepped.status is RequestStatus.FINISHED
    assert len(output.output_token_ids) == 12
    assert llm.step() == [stepped]
    assert llm.step() == []


def test_a_failed_start_removes_the_disk_directory_it_created(tmp_path: Path) -> None:
    """`disk_path` is created before the model loads (a check that fails fast); a start
    that fails afterwards (here: a mistyped checkpoint path) removes it again."""
    disk = tmp_path / "tier"
    config = OffloadConfig(
        disk_bytes=1 << 20, disk_path=str(disk), disk_io_mode=DiskIOMode.PAGE_CACHE
    )
    with pytest.raises(FileNotFoundError, match="not a local checkpoint directory"):
        LLM(str(tmp_path / "no-such-checkpoint"), kv_offload=config)
    assert not disk.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    config = OffloadConfig(
        disk_bytes=1 << 20, disk_path=str(existing), disk_io_mode=DiskIOMode.PAGE_CACHE
    )
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "no-such-checkpoint"), kv_offload=config)
    assert existing.is_dir()  # not created by the engine: kept


def test_a_request_that_finishes_inside_drain_is_returned_by_the_next_step() -> None:
    """Regression: `drain` threw away what its steps returned, so a request queued by
    `add_request` that finished there was never returned (a step loop waiting for it
    spun forever)."""
    llm = LLM(
        None, kv_offload=OFFLOADS["eager"], engine=EngineConfig(num_gpu_blocks=32, block_size=4)
    )
    short = llm.add_request([*range(9)], SamplingParams(max_tokens=1, ignore_eos=True))
    long = llm.add_request([*range(20, 29)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.step() == [short]  # both prefilled; short's finish-time store is queued
    assert llm.offload is not None
    assert llm.offload.has_pending_work()
    llm.drain()  # its first step decodes long's last token
    assert long.status is RequestStatus.FINISHED
    assert llm.step() == [long]
    assert llm.step() == []
    llm.shutdown()
