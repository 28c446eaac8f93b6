"""A request's timing (`ttft`, `tpot`) and the extra keys it gives the offload side."""

from __future__ import annotations

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig, StoreMode

ENGINE = EngineConfig(block_size=4, num_gpu_blocks=17)


def test_ttft_is_to_the_first_token_and_tpot_the_mean_gap_after_it() -> None:
    """Tokens at times 1, 2 and 4 (steps applied with explicit times): the first token
    came 1 after arrival, the two gaps after it average 1.5.
    Mutations: the first token's time taken at every token (ttft 4, tpot 0); the mean
    over every token, not the gaps (tpot 1)."""
    llm = LLM(ModelConfig.tiny(), engine=ENGINE)
    request = llm.add_request(list(range(6)), SamplingParams(max_tokens=3, ignore_eos=True))
    request.arrival_time = 0.0
    for token, now in ((7, 1.0), (8, 2.0), (9, 4.0)):
        assert request.tpot is None
        step = llm.scheduler.schedule()
        llm.scheduler.complete(step, [token], now)
    assert request.output_token_ids == [7, 8, 9]
    assert (request.first_token_time, request.finish_time) == (1.0, 4.0)
    assert (request.ttft, request.tpot) == (1.0, 1.5)
    llm.shutdown()


def test_blocks_extra_keys_are_those_of_each_block() -> None:
    """Mutation: the blocks were one token short (ValueError: not a block)."""
    llm = LLM(ModelConfig.tiny(), engine=ENGINE)
    request = llm.add_request(list(range(13)), SamplingParams(max_tokens=1))
    expected = [request.block_extra_keys(start, start + 4) for start in (0, 4, 8)]
    assert request.blocks_extra_keys(4, 3) == expected
    llm.shutdown()


def test_lazy_stores_with_events_serve_a_prompt_again() -> None:
    """SPEC scenarios 5 and 31 with KV events on: a 60-token prompt pushes the first
    prompt's blocks out of the GPU pool, lazily stored on the way (the walk notes each
    request's cached blocks with their extra keys, `blocks_extra_keys`); the first
    prompt again loads from the CPU tier, and every output matches an engine without
    offload. Mutation: as above (the walk raised ValueError inside a step)."""
    tier = OffloadConfig(cpu_bytes=4 << 20, store_mode=StoreMode.LAZY, events=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = list(range(13))
    prompts = [first, list(range(64, 124)), first, [*range(8), 50, 51, 52]]
    with LLM(ModelConfig.tiny(), engine=ENGINE) as plain:
        expected = [out.output_token_ids for out in plain.generate(prompts, params)]
    with LLM(ModelConfig.tiny(), tier, ENGINE) as llm:
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
        llm.drain()
    assert [out.output_token_ids for out in outputs] == expected
    assert outputs[2].num_external_hit_tokens > 0
