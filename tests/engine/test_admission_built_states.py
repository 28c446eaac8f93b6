"""Admission with tier hits in states built directly: a fake offload side answers every
lookup with a hit of a set length (the engine's own block pool and queues are real).
What is checked is the admission's decision and the counts it records; no model runs
on blocks a fake load never wrote.
"""

from __future__ import annotations

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.transfers import FailedLoad, ReportOutcome

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


class TierWithHit:
    """An offload side whose tiers hold `num_tokens` past any local prefix; it records
    the cap of each lookup and the external tokens each allocation accepted."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.caps: list[int | None] = []
        self.accepted: list[int] = []

    def lookup(self, request: Request, num_local_tokens: int, max_tokens: int | None = None) -> int:
        self.caps.append(max_tokens)
        return self.num_tokens if max_tokens is None else min(max_tokens, self.num_tokens)

    def on_allocated(self, request: Request, tables: object, num_external_tokens: int) -> None:
        self.accepted.append(num_external_tokens)

    def on_finished(self, request: Request, tables: object) -> None:
        pass

    def holds_gpu_blocks_alone(self) -> bool:
        return False


def with_tier(model: ModelConfig, num_gpu_blocks: int, tier: TierWithHit) -> LLM:
    llm = LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=num_gpu_blocks))
    llm.scheduler.offload = tier  # type: ignore[assignment]
    return llm


def test_a_request_whose_load_failed_never_asks_the_tier_again() -> None:
    """A failed load rewinds its request with `skip_external`: it recomputes, and every
    later admission (after a preemption, say: the offload side's own refusal, its
    `recompute_next`, lasts only until the request is allocated again) asks the tier for
    nothing, though the tier has a hit. A request without it takes the hit.
    Mutation: `cap = None` for a request with `skip_external` (it was admitted to load
    the 8 tokens again, WAITING_FOR_LOAD)."""
    tier = TierWithHit(8)
    llm = with_tier(ModelConfig.tiny(), 9, tier)
    failed = llm.add_request(list(range(13)), ONE)
    failed.skip_external = True  # as `rewind` leaves it
    fresh = llm.add_request(list(range(20, 33)), ONE)
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(failed, 13)]
    assert (failed.status, failed.num_external_tokens_total) == (RequestStatus.RUNNING, 0)
    assert (fresh.status, fresh.num_external_tokens_total) == (RequestStatus.WAITING_FOR_LOAD, 8)
    assert (tier.caps, tier.accepted) == ([0, None], [0, 8])


def test_hits_of_a_readmission_after_the_first_token_stay_the_first_admissions() -> None:
    """A request preempted after its first token (its hits: 12 tier tokens) is admitted
    again with 8 local tokens (another request's cached blocks) and 4 from the tier. Its
    hit counts stay those of the admission its first token came from.
    Mutations: the re-admission's local (8) or external (4) hit replaced them."""
    tier = TierWithHit(0)
    llm = with_tier(ModelConfig.tiny(), 9, tier)
    prefix = list(range(8))
    earlier = llm.add_request([*prefix, 8], ONE)
    step = llm.scheduler.schedule()
    assert llm.scheduler.complete(step, [3], 0.0) == [earlier]  # its 2 full blocks cached
    again = llm.add_request([*prefix, *range(8, 15)], SamplingParams(max_tokens=4))
    again.append_output(20, 1.0)  # its first token, then preempted: no blocks
    again.num_local_tokens_total, again.num_external_tokens_total = 0, 12
    tier.num_tokens = 4
    llm.scheduler.schedule()
    assert (again.status, again.num_external_tokens, again.num_computed_tokens) == (
        RequestStatus.WAITING_FOR_LOAD,
        4,
        12,
    )
    assert (again.num_local_tokens_total, again.num_external_tokens_total) == (0, 12)


def test_a_lone_request_with_a_hit_reserves_one_token_after_its_load() -> None:
    """A sliding window (tiny_hybrid: window 8): a 40-token prompt with a 16-token tier
    hit, in a pool of its peak blocks. Its hit plus the rest of the prompt in one chunk
    does not fit (a window group holds a chunk's blocks while it is computed), one token
    after the hit does; alone, with no load in flight, it is admitted with room for one
    token (it then runs in chunks that fit).
    Mutation: it reserved the whole chunk, was never admitted (then taken as stalled)."""
    model = ModelConfig.tiny_hybrid()
    tier = TierWithHit(16)
    llm = with_tier(model, 14, tier)  # 13 usable: its peak
    request = llm.add_request(list(range(40)), ONE)
    llm.scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_LOAD
    assert (request.num_external_tokens, tier.accepted) == (16, [16])
    assert llm.scheduler.loading == {request.request_id: request}


def test_a_load_reserves_the_next_token_of_each_request_loading() -> None:
    """Full attention, 9 usable blocks, two 17-token prompts with 16-token tier hits: the
    first is admitted (4 blocks, and room for its 17th token's block). The second's 4 +
    1 blocks fit the 5 free, not with the first one's next block: it waits.
    Mutation: one token less reserved for each request loading (the second loaded too)."""
    tier = TierWithHit(16)
    llm = with_tier(ModelConfig.tiny(), 10, tier)
    first = llm.add_request(list(range(17)), ONE)
    second = llm.add_request(list(range(20, 37)), ONE)
    llm.scheduler.schedule()
    assert list(llm.scheduler.loading.values()) == [first]
    assert (second.status, second.block_tables) == (RequestStatus.WAITING, [[]])
    assert llm.pool.num_free() == 5


def test_blocks_a_load_filled_are_cached_for_later_requests() -> None:
    """A load finished: its request's loaded blocks are keyed in the GPU pool, and a later
    request with the same 16-token prefix finds them as a local hit.
    Mutation: the loaded blocks were not cached (the later request found no hit)."""
    tier = TierWithHit(16)
    llm = with_tier(ModelConfig.tiny(), 13, tier)
    prefix = list(range(16))
    loaded = llm.add_request([*prefix, 30], ONE)
    llm.scheduler.schedule()
    assert loaded.status is RequestStatus.WAITING_FOR_LOAD
    tier.num_tokens = 0
    llm.scheduler.apply_offload(ReportOutcome(finished_loads=(loaded.request_id,)))
    assert all(llm.pool.key(block) is not None for block in loaded.block_tables[0][:4])
    later = llm.add_request([*prefix, 40, 41], ONE)
    llm.scheduler.schedule()
    assert (later.status, later.num_local_tokens_total) == (RequestStatus.RUNNING, 16)
    assert later.block_tables[0][:4] == loaded.block_tables[0][:4]


def test_a_hit_on_blocks_a_running_request_holds_takes_no_free_block_for_them() -> None:
    """No offload. Full attention, 4 usable blocks: a request runs on 3 (its first 8
    tokens cached); a new one shares those 8 tokens and needs one block for its 3 more,
    the one free. Its hit blocks are held already: it is admitted.
    Mutation: hit blocks held once were counted as taken from the free ones (it waited)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    first = llm.add_request(list(range(9)), SamplingParams(max_tokens=3, ignore_eos=True))
    step = llm.scheduler.schedule()
    llm.scheduler.complete(step, [50], 0.0)
    shared = llm.add_request([*range(8), 60, 61, 62], ONE)
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(first, 1), (shared, 3)]
    assert shared.num_local_tokens_total == 8
    assert shared.block_tables[0][:2] == first.block_tables[0][:2]
    assert llm.pool.num_free() == 0


def test_a_request_back_from_a_one_token_load_keeps_its_block_and_its_hit() -> None:
    """Blocks of 1 token: a 2-token prompt loads its first token from the tier. Back from
    the load it holds 1 computed token: it runs its second on the block it loaded (not
    admitted anew), keeps its external hit, and leaves every block free once finished.
    Mutation: "back from a load" taken as more than 1 computed token (admitted anew over
    its table: the loaded block leaked, its hit counted as a local one)."""
    tier = TierWithHit(1)
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=1, num_gpu_blocks=5))
    llm.scheduler.offload = tier  # type: ignore[assignment]
    request = llm.add_request([5, 6], ONE)
    llm.scheduler.schedule()
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING_FOR_LOAD, 1)
    (loaded,) = request.block_tables[0]
    tier.num_tokens = 0
    llm.scheduler.apply_offload(ReportOutcome(finished_loads=(request.request_id,)))
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(request, 1)]
    assert request.block_tables[0][0] == loaded
    assert (request.num_local_tokens_total, request.num_external_tokens_total) == (0, 1)
    assert llm.scheduler.complete(step, [7], 0.0) == [request]
    assert llm.pool.num_free() == llm.pool.num_usable_blocks


def test_a_load_reserves_one_batch_of_its_own_chunk_not_its_whole_rest() -> None:
    """Full attention, blocks of 4, batches of 8 tokens, 10 usable blocks: a request runs
    on 2; a 40-token prompt with a 16-token tier hit needs its 4 hit blocks and, once
    loaded, the 2 blocks of its next chunk (one batch, 8 tokens), not the 6 of its whole
    rest: 6 of the 8 free. It is admitted to load.
    Mutation: its whole rest reserved (it waited, WAITING)."""
    tier = TierWithHit(0)
    llm = LLM(
        ModelConfig.tiny(),
        engine=EngineConfig(block_size=4, num_gpu_blocks=11, max_num_batched_tokens=8),
    )
    llm.scheduler.offload = tier  # type: ignore[assignment]
    runner = llm.add_request(list(range(5)), SamplingParams(max_tokens=3, ignore_eos=True))
    llm.scheduler.complete(llm.scheduler.schedule(), [9], 0.0)
    assert llm.pool.num_free() == 8
    tier.num_tokens = 16
    loader = llm.add_request(list(range(20, 60)), ONE)
    step = llm.scheduler.schedule()
    assert [(work.request, work.num_new_tokens) for work in step.work] == [(runner, 1)]
    assert (loader.status, loader.num_external_tokens) == (RequestStatus.WAITING_FOR_LOAD, 16)
    assert llm.pool.num_free() == 4


def test_a_load_reserves_one_batch_of_each_loading_requests_chunk() -> None:
    """Full attention, blocks of 4, batches of 8 tokens, 12 usable blocks, 16-token tier
    hits: a 40-token prompt loads (4 blocks; its next chunk, one batch, needs 2 more).
    A 17-token prompt needs 4 + 1 blocks and the first's 2: 7 of the 8 free. Both load.
    Mutation: the first's whole rest (6 blocks) reserved (the second waited)."""
    tier = TierWithHit(16)
    llm = LLM(
        ModelConfig.tiny(),
        engine=EngineConfig(block_size=4, num_gpu_blocks=13, max_num_batched_tokens=8),
    )
    llm.scheduler.offload = tier  # type: ignore[assignment]
    first = llm.add_request(list(range(40)), ONE)
    second = llm.add_request(list(range(50, 67)), ONE)
    llm.scheduler.schedule()
    assert list(llm.scheduler.loading.values()) == [first, second]
    assert (second.status, second.num_external_tokens) == (RequestStatus.WAITING_FOR_LOAD, 16)
    assert llm.pool.num_free() == 4


def test_a_load_reported_both_finished_and_failed_counts_as_finished() -> None:
    """Full attention, blocks of 4: a 17-token prompt loads a 16-token tier hit. An
    outcome names its load both finished and failed (a request both finished and failed:
    finished): it keeps its 16 loaded tokens and blocks, cached, and its hit; it is not
    rewound nor told to skip the tier.
    Mutation: a failure rewound it even when its load was reported finished (its blocks
    freed, recomputed from token 0)."""
    tier = TierWithHit(16)
    llm = with_tier(ModelConfig.tiny(), 10, tier)
    request = llm.add_request(list(range(17)), ONE)
    llm.scheduler.schedule()
    table = list(request.block_tables[0])
    assert (request.status, len(table)) == (RequestStatus.WAITING_FOR_LOAD, 4)
    rid = request.request_id
    outcome = ReportOutcome(finished_loads=(rid,), failed_loads=(FailedLoad(rid, 0, 16),))
    llm.scheduler.apply_offload(outcome)
    assert list(llm.scheduler.waiting) == [request]
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING, 16)
    assert request.block_tables == [table]
    assert all(llm.pool.key(block) is not None for block in table)
    assert (request.skip_external, request.num_external_tokens_total) == (False, 16)


def test_a_finished_load_queued_after_a_preemption_cut_short_leaves_it_in_one_queue() -> None:
    """A preemption cut short by an interrupt (Ctrl-C) left the preempted request at the
    head of `waiting` and still last in `running`. A load finishing now is applied first
    (the engine applies an outcome before it schedules): the cut-short move is finished
    before the loaded request goes to the front of `waiting`, so the preempted request
    is in one queue only, behind it.
    Mutation: `apply_offload` did not `_settle` first (the loaded request in front hid
    the half-moved one from the next `_settle`: in `running` and `waiting` both)."""
    tier = TierWithHit(16)
    llm = with_tier(ModelConfig.tiny(), 10, tier)
    loaded = llm.add_request(list(range(17)), ONE)
    llm.scheduler.schedule()
    assert loaded.status is RequestStatus.WAITING_FOR_LOAD
    caught = llm.add_request(list(range(40, 45)), ONE)
    caught.block_tables, caught.num_computed_tokens = [llm.pool.allocate(1)], 4
    scheduler = llm.scheduler
    scheduler.running.append(caught)  # it ran; then its preemption was cut short:
    caught.status = RequestStatus.WAITING  # in `waiting` (its place), still in `running`
    assert list(scheduler.waiting) == [caught]
    scheduler.apply_offload(ReportOutcome(finished_loads=(loaded.request_id,)))
    assert scheduler.running == []
    assert list(scheduler.waiting) == [loaded, caught]
    assert (caught.num_computed_tokens, len(caught.block_tables[0])) == (4, 1)
