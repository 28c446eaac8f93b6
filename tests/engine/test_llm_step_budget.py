"""What one scheduler step may carry, checked on every step of small busy runs: at most
`max_num_batched_tokens` tokens and `max_num_seqs` requests, at least one token per
scheduled request, and (as vLLM) no new admission in a step that preempted or waits for
blocks to come back. The tokens are those of a roomy engine.

Found by a mutation run (s30): a running request's chunk not capped by the budget, the
budget not charged for running or admitted work, one request more than
`max_num_seqs`, FCFS broken by a preempted request queued at the back, and the
engine's counters of preemptions, computed and prompt tokens not kept all left the
engine's tests passing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import SchedulerStep
from kvtier.offload.config import OffloadConfig

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@dataclass(frozen=True)
class Seen:
    """One step: its (request id, tokens) work, and which of them were admitted in it."""

    work: tuple[tuple[str, int], ...]
    admitted: tuple[str, ...]  # in the order admitted
    preempted: frozenset[str]
    waits_for_frees: bool


def _recorded(llm: LLM) -> list[Seen]:
    """Record every step `llm.scheduler.schedule` decides."""
    steps: list[Seen] = []
    schedule = llm.scheduler.schedule

    def recording() -> SchedulerStep:
        running = {r.request_id for r in llm.scheduler.running}
        step = schedule()
        work = tuple((w.request.request_id, w.num_new_tokens) for w in step.work)
        admitted = tuple(rid for rid, _ in work if rid not in running)
        steps.append(Seen(work, admitted, frozenset(step.preempted_ids), step.waits_for_frees))
        return step

    llm.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


def _arrival(request_id: str) -> int:
    return int(request_id.split("-")[1])


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(length)] for _ in range(count)]


def _run(
    engine: EngineConfig, prompts: list[list[int]]
) -> tuple[list[tuple[int, ...]], list[Seen]]:
    """Return the outputs and the steps; check the preemption counters against the steps."""
    with LLM(None, engine=engine) as llm:
        steps = _recorded(llm)
        outputs = [out.output_token_ids for out in llm.generate(prompts, PARAMS)]
        num_preempted = sum(len(step.preempted) for step in steps)
        assert llm.stats.num_preemptions == llm.scheduler.num_preemptions == num_preempted
        assert llm.stats.num_computed_tokens == sum(n for step in steps for _, n in step.work)
        assert llm.stats.num_prompt_tokens == sum(map(len, prompts))
    return outputs, steps


def test_every_step_keeps_to_the_token_budget_and_the_batch_size() -> None:
    """Prompts of 11 tokens, 5 requests at once, a budget of 7 tokens, 3 sequences: the
    prompts are chunked and the decodes of the running requests share the budget."""
    prompts = _prompts(5, 11, seed=1)
    expected, _ = _run(EngineConfig(block_size=4, num_gpu_blocks=64), prompts)
    engine = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=7, max_num_seqs=3)
    outputs, steps = _run(engine, prompts)
    assert outputs == expected
    assert any(len(step.work) > 1 for step in steps)
    for step in steps:
        assert sum(n for _, n in step.work) <= 7, step
        assert all(n >= 1 for _, n in step.work), step
        assert len(step.work) <= 3, step


def test_a_step_that_preempts_or_waits_admits_nothing_and_tokens_stay_the_same() -> None:
    """A pool of 12 blocks of 4 tokens for 6 requests growing to 16 tokens: running
    requests are preempted, and resume where they left."""
    prompts = _prompts(6, 10, seed=2)
    expected, _ = _run(EngineConfig(block_size=4, num_gpu_blocks=64), prompts)
    engine = EngineConfig(block_size=4, num_gpu_blocks=13, max_num_batched_tokens=24)
    outputs, steps = _run(engine, prompts)
    assert outputs == expected
    assert any(step.preempted for step in steps)
    for step in steps:
        if step.preempted or step.waits_for_frees:
            assert not step.admitted, step
    # A preempted request goes back to the front of the queue: none that arrived after it
    # is admitted for the first time before it runs again.
    started: set[str] = set()
    preempted: set[str] = set()  # preempted, not yet admitted again
    for step in steps:
        for rid in step.admitted:
            if rid not in started:
                assert all(_arrival(rid) < _arrival(p) for p in preempted), (rid, preempted)
            preempted.discard(rid)
            started.add(rid)
        preempted |= step.preempted


def test_a_request_back_from_its_load_keeps_to_the_token_budget() -> None:
    """A prompt whose first 8 tokens come from the CPU tier and 20 more are computed: back
    from its load, it computes them in chunks of the budget. Mutation: the chunk after a
    load was not capped by the budget (20 tokens in one step)."""
    prefix = list(range(100, 108))
    engine = EngineConfig(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=7)
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=1 << 22), engine=engine) as llm:
        llm.generate([[*prefix, 1]], PARAMS)  # its two full blocks are stored
        llm.generate([list(range(36))], PARAMS)  # evicts them from the GPU pool
        llm.drain()
        steps = _recorded(llm)
        (out,) = llm.generate([[*prefix, *range(20)]], PARAMS)
    assert out.num_external_hit_tokens == 8
    for step in steps:
        assert sum(n for _, n in step.work) <= 7, step
