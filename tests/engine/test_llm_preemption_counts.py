"""`LLM.stats.num_preemptions` counts preempted running requests only; freeing the idle
blocks of waiting requests back from a load (`Scheduler._release_idle_blocks`) is
counted apart, in `num_idle_releases`.

Regression: each idle release was counted as a preemption, so a run where nothing
running was ever preempted reported preemptions.
"""

from __future__ import annotations

from typing import Any

from test_llm_offload import Synchronous

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

MIB = 1 << 20
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def counted_calls(llm: LLM, name: str) -> list[str]:
    """Record the request id of every call of the scheduler's method `name`."""
    calls: list[str] = []
    method = getattr(llm.scheduler, name)

    def recording(request: Any, *args: Any) -> Any:
        calls.append(request.request_id)
        return method(request, *args)

    setattr(llm.scheduler, name, recording)
    return calls


def test_idle_releases_are_not_counted_as_preemptions() -> None:
    """The scenario of test_llm_lifecycle's livelock regression: A' and B' come back from
    their loads while Q runs (max_num_seqs=1 keeps them waiting); Q, short of blocks,
    frees their idle blocks. Every `_drop_kv` not made by `_preempt` is such a release.

    The copies run synchronously: whether the loads end while Q runs followed the copy
    threads (a slow load thread, 2 busy cores, left no idle blocks to release)."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=9, max_num_seqs=1, max_num_batched_tokens=3)
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine) as llm:
        assert llm.offload is not None
        llm.offload.worker = Synchronous(llm.offload.worker)  # type: ignore[assignment]
        first, second = list(range(12)), list(range(50, 62))
        llm.generate([first, second], ONE)  # stored in the tier when they finish
        llm.generate([list(range(70, 102))], ONE)  # 8 blocks: evicts both from the GPU
        llm.drain()
        before = (llm.stats.num_preemptions, llm.stats.num_idle_releases)
        preempted = counted_calls(llm, "_preempt")
        dropped = counted_calls(llm, "_drop_kv")
        prompts = [[*first, 1], [*second, 2], list(range(20, 40))]
        two, nine = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 9))
        outputs = llm.generate(prompts, [two, two, nine])
        assert [o.num_external_hit_tokens > 0 for o in outputs[:2]] == [True, True]
        num_released = len(dropped) - len(preempted)
        assert num_released > 0, "no idle blocks were released: the scenario changed"
        assert (llm.stats.num_preemptions, llm.stats.num_idle_releases) == (
            before[0] + len(preempted),
            before[1] + num_released,
        )
        assert (llm.scheduler.num_preemptions, llm.scheduler.num_idle_releases) == (
            llm.stats.num_preemptions,
            llm.stats.num_idle_releases,
        )


def test_each_preempted_running_request_counts_once() -> None:
    """Without offloading (no request holds idle blocks), a pool too small for three
    growing requests preempts: the count is the number of `_preempt` calls."""
    with LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=9)) as llm:
        preempted = counted_calls(llm, "_preempt")
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        llm.generate([list(range(10)), list(range(20, 30)), list(range(40, 50))], params)
        assert preempted, "nothing was preempted: the scenario changed"
        assert (llm.stats.num_preemptions, llm.stats.num_idle_releases) == (len(preempted), 0)
