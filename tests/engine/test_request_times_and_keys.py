"""A request's timing (`ttft`, `tpot`) and the extra keys it gives the offload side."""

from __future__ import annotations

from kvtier.core.extra_keys import RequestExtras
from kvtier.core.hashing import BlockHasher, HashAlgo, RequestHasher
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig, StoreMode

ENGINE = EngineConfig(block_size=4, num_gpu_blocks=17)
HASHER = BlockHasher(4, HashAlgo.SHA256, None)


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


def test_ttft_counts_from_arrival_and_a_request_without_tokens_has_no_tpot() -> None:
    """Arrival at 10, first token at 12.5: ttft 2.5 (mutant s35: the token's time alone).
    A request finished before its first token (aborted) has no tpot, not a TypeError
    (mutant s35: only the finish time checked)."""
    request = Request("r", [1, 2, 3], SamplingParams(), RequestHasher(HASHER))
    request.arrival_time = 10.0
    request.finish_time = 11.0
    assert (request.ttft, request.tpot) == (None, None)
    request.append_output(4, 12.5)
    assert request.ttft == 2.5


def test_outputs_are_counted_apart_from_the_prompt_and_never_placeholders() -> None:
    """The reference engine confirms every token the step it is computed, so none is a
    placeholder (the offload side's confirmed tokens, SPEC §6.5), and the prompt stays
    the prompt. Mutants (s35): either counting the outputs passed the request tests."""
    request = Request("r", [1, 2, 3], SamplingParams(), RequestHasher(HASHER))
    request.append_output(4, 1.0)
    request.append_output(5, 2.0)
    assert (request.num_prompt_tokens, request.num_tokens) == (3, 5)
    assert request.num_output_placeholders == 0


def test_blocks_extra_keys_follow_each_blocks_position() -> None:
    """A cache salt keys the first block alone (as vLLM's): each block's own extra keys.
    Mutant (s35): the first block's keys for every block passed (the engine's own
    requests carry no extras)."""
    hasher = RequestHasher(HASHER, RequestExtras(cache_salt="salt"))
    request = Request("r", list(range(12)), SamplingParams(), hasher)
    keys = request.blocks_extra_keys(4, 3)
    assert keys == [request.block_extra_keys(s, s + 4) for s in (0, 4, 8)]
    assert keys[0] != keys[1]


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
