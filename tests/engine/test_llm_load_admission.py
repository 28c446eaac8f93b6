"""Admission with a tier hit: the pool must also hold the chunk the request computes once
its load is done, and the chunks of the requests loading now (as vLLM reserves blocks
for in-flight prefills).

Regression: a request was admitted where only its hit's blocks fit. Back from its load
it found no room for its prompt's rest (the running requests had grown), held its blocks
idle until a running request short of blocks freed them (then counted as a preemption,
now in `num_idle_releases`), and then loaded its hit again. With offload off the same
request waited for room for its whole prompt, and nothing was preempted.
"""

from __future__ import annotations

from held_reports import reports_held_back

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

MODEL = ModelConfig.tiny()  # full attention only
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=13)  # 12 usable blocks
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
P = list(range(16))  # 4 blocks, stored to the tier
Q = list(range(20, 36))  # 4 blocks, stored to the tier
EVICT = list(range(40, 85))  # 12 blocks: pushes P and Q out of the GPU cache
LONG = list(range(100, 128))  # 7 blocks, decodes into 9
TAIL = list(range(110, 122))  # 3 blocks after a 16-token hit


def tier() -> OffloadConfig:
    return OffloadConfig(cpu_bytes=64 * ENGINE.block_size * MODEL.kv_bytes_per_token())


def warmed(offload: OffloadConfig | None) -> LLM:
    """Return an engine whose tier (if any) holds P and Q, which its GPU cache does not."""
    llm = LLM(MODEL, offload, ENGINE)
    for prompt in ([*P, 99, 98, 97, 96], [*Q, 99, 98, 97, 96], EVICT):
        llm.generate([prompt], ONE)
        llm.drain()
    return llm


def run_all(llm: LLM, requests: list[Request]) -> list[tuple[int, ...]]:
    finished: set[str] = set()
    while len(finished) < len(requests):
        finished.update(r.request_id for r in llm.step())
    return [tuple(r.output_token_ids) for r in requests]


def num_blocks_taken_back(llm: LLM) -> int:
    """Return how often a request's blocks were freed before it finished."""
    return llm.stats.num_preemptions + llm.stats.num_idle_releases


def serve_beside_a_decoder(offload: OffloadConfig | None) -> tuple[list[tuple[int, ...]], int]:
    with warmed(offload) as llm:
        taken_back = num_blocks_taken_back(llm)
        decoder = llm.add_request(LONG, SamplingParams(max_tokens=8, ignore_eos=True))
        hit = llm.add_request([*P, *TAIL], SamplingParams(max_tokens=2, ignore_eos=True))
        llm.step()
        # 7 blocks run, 5 free: P's 4 fit, not with its 3 after them.
        assert hit.status is RequestStatus.WAITING
        assert hit.block_tables == [[]]
        # Not admitted, its tier hit stays pinned until its next lookup or its finish.
        pins = None if llm.offload is None else llm.offload.scheduler.loads.pins
        assert pins is None or hit.request_id in pins
        outputs = run_all(llm, [decoder, hit])
        assert pins is None or hit.request_id not in pins
        assert (hit.num_local_tokens_total, hit.num_external_tokens_total) == (
            (0, 16) if offload else (0, 0)
        )
        return outputs, num_blocks_taken_back(llm) - taken_back


def test_a_load_waits_for_room_for_the_chunk_after_it() -> None:
    off, num_off = serve_beside_a_decoder(None)
    on, num_on = serve_beside_a_decoder(tier())
    assert on == off
    assert num_on == num_off == 0  # was 1: the idle loaded request's blocks were freed


def test_a_load_leaves_room_for_the_chunks_of_those_loading() -> None:
    with warmed(tier()) as llm:
        first = llm.add_request([*P, *TAIL], ONE)
        second = llm.add_request([*Q, *TAIL], ONE)
        with reports_held_back(llm):
            llm.step()
        # Both hits fit (8 of 12 blocks), not both with their 3 after them (14).
        assert first.status is RequestStatus.WAITING_FOR_LOAD
        assert (second.status, second.block_tables) == (RequestStatus.WAITING, [[]])
        outputs = run_all(llm, [first, second])
        assert [r.num_external_tokens_total for r in (first, second)] == [16, 16]
    with warmed(None) as reference:
        expected = [
            out.output_token_ids for out in reference.generate([[*P, *TAIL], [*Q, *TAIL]], ONE)
        ]
    assert outputs == [tuple(tokens) for tokens in expected]
