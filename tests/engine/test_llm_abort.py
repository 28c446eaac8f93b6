"""`LLM.abort_request`: a request queued by `add_request` is stopped by its caller."""

from __future__ import annotations

import copy

import pytest
from held_reports import reports_held_back
from test_llm_lifecycle import PARAMS, assert_idle

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason, SamplingParams
from kvtier.offload.config import OffloadConfig

MIB = 1 << 20
LONG = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_an_aborted_request_frees_its_blocks_and_is_never_returned(when: str) -> None:
    engine = EngineConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=1)
    llm = LLM(None, engine=engine)
    prompts = [[*range(10), 50], [*range(10), 60]]  # a shared prefix of two blocks
    first, second = (llm.add_request(prompt, LONG) for prompt in prompts)
    llm.step()  # max_num_seqs=1: the first runs, the second waits
    victim = first if when == "running" else second
    llm.abort_request(victim)
    assert (victim.status, victim.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    returned = []
    while llm.scheduler.has_unfinished():
        returned += llm.step()
    survivor = second if victim is first else first
    assert returned == [survivor]
    (expected,) = LLM(None, engine=engine).generate([survivor.prompt_token_ids], LONG)
    assert tuple(survivor.output_token_ids) == expected.output_token_ids
    llm.abort_request(victim)  # finished: left as is
    llm.abort_request(survivor)
    assert survivor.finish_reason is not FinishReason.ABORT
    assert_idle(llm)


def start_a_load(llm: LLM, prompt: list[int]) -> Request:
    """Store `prompt`, evict it from the GPU pool, then add it again and step once:
    return the request, waiting for its load from the tier (issued, not reported)."""
    llm.generate([prompt], PARAMS)
    llm.generate([list(range(40))], PARAMS)  # evicts the prompt from the GPU pool
    llm.drain()
    request = llm.add_request(prompt, PARAMS)
    with reports_held_back(llm):
        llm.step()  # the load is issued
    assert request.status is RequestStatus.WAITING_FOR_LOAD
    return request


def test_a_request_aborted_while_its_load_is_in_flight_leaves_the_tier_consistent() -> None:
    """The load's pins hold its GPU blocks until the worker reports it; the prompt is
    then served again, from the tier, with the tokens of a fresh engine."""
    engine = EngineConfig(num_gpu_blocks=12, block_size=4)
    prompt = list(range(60, 92))
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine) as llm:
        request = start_a_load(llm, prompt)
        llm.abort_request(request)
        assert_idle(llm)
        (again,) = llm.generate([prompt], PARAMS)
        assert again.num_external_hit_tokens > 0
        (fresh,) = LLM(None, engine=engine).generate([prompt], PARAMS)
        assert again.output_token_ids == fresh.output_token_ids
        assert_idle(llm)


def test_abort_request_refuses_what_is_not_this_engine_s_request() -> None:
    llm = LLM(None, engine=EngineConfig(num_gpu_blocks=16, block_size=4))
    other = LLM(None, engine=EngineConfig(num_gpu_blocks=16, block_size=4))
    foreign = other.add_request([1, 2, 3], PARAMS)
    with pytest.raises(ValueError, match=f"{foreign.request_id} is not a request of this engine"):
        llm.abort_request(foreign)
    with pytest.raises(TypeError, match="expected a Request from add_request, got 'req-0'"):
        llm.abort_request("req-0")  # type: ignore[arg-type]
    assert foreign.status is RequestStatus.WAITING
    own = llm.add_request([1, 2, 3], PARAMS)
    with pytest.raises(ValueError, match="is not a request of this engine"):
        llm.abort_request(copy.copy(own))  # equal, not the same: it held own's place
    assert own.status is RequestStatus.WAITING
    assert llm.scheduler.holds(own)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.abort_request(foreign)


def test_requests_compare_by_identity_in_the_scheduler_s_queues() -> None:
    """`Scheduler.abort` of a copy leaves the original queued: its `in`/`remove` compared
    every field, so an equal copy removed the original (and kept logits, being tensors,
    made the comparison raise)."""
    llm = LLM(None, engine=EngineConfig(num_gpu_blocks=16, block_size=4))
    own = llm.add_request([1, 2, 3], PARAMS)
    double = copy.copy(own)
    assert double != own
    llm.scheduler.abort(double)
    assert list(llm.scheduler.waiting) == [own]
    assert own.status is RequestStatus.WAITING
    (done,) = [r for _ in range(8) for r in llm.step()]
    assert done is own
    assert_idle(llm)


def test_a_loading_request_is_unfinished_and_its_copy_is_not_this_engines() -> None:
    """While its load is in flight a request is unfinished (a reset waits for it) and only
    the request itself is this engine's. Mutations: `has_unfinished` not counting the
    loading ones let `reset_prefix_cache` drop the cache under the load (True); `holds`
    matching the loading one by id took an equal copy for it (no ValueError); an abort
    not telling the offload side left the request tracked there."""
    engine = EngineConfig(num_gpu_blocks=12, block_size=4)
    prompt = list(range(60, 92))
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine) as llm:
        request = start_a_load(llm, prompt)
        assert llm.scheduler.has_unfinished()
        assert llm.reset_prefix_cache() is False
        with pytest.raises(ValueError, match="is not a request of this engine"):
            llm.abort_request(copy.copy(request))
        assert llm.scheduler.holds(request)
        assert llm.offload is not None
        tracked = llm.offload.scheduler.selector.tracked
        assert request.request_id in tracked
        llm.abort_request(request)
        assert request.request_id not in tracked  # its offload state went with it
        assert_idle(llm)
