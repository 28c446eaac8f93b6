"""`OffloadScheduler.holds_gpu_blocks_alone` (vLLM's `has_pending_block_frees`): True only
while a queued or issued transfer holds the last reference on a GPU block."""

from __future__ import annotations

from sim import SimEngine, full_layout, make_request
from test_scenarios_lifecycle import loading_engine

from kvtier.offload.plan import TransferJob


def finish_then_complete(engine: SimEngine, request_id: str, job: TransferJob) -> None:
    """Assert the issued `job` holds its GPU blocks alone only from the request's
    finish until its completion is applied."""
    assert not engine.scheduler.holds_gpu_blocks_alone(), "the request holds them too"
    engine.finish(request_id)
    assert engine.scheduler.holds_gpu_blocks_alone()
    engine.worker.complete(job.event_id)
    engine.poll()
    engine.drain()
    assert not engine.scheduler.holds_gpu_blocks_alone()
    engine.check()


def test_a_load_holds_its_destinations_alone_once_its_request_finished() -> None:
    engine, _ = loading_engine()
    assert not engine.scheduler.holds_gpu_blocks_alone(), "queued: the request holds them too"
    (load,) = engine.step().jobs
    finish_then_complete(engine, "b", load)


def test_a_store_holds_its_sources_alone_once_its_request_finished() -> None:
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    engine.admit(make_request("a", range(8), outputs=[50, 51]))
    engine.schedule("a")
    engine.step()
    engine.schedule("a")
    (store,) = engine.step().jobs  # the prompt's blocks, stored while "a" decodes
    finish_then_complete(engine, "a", store)


def test_a_finish_time_store_queued_but_not_issued_counts() -> None:
    engine = SimEngine(full_layout())
    engine.auto_complete = False
    engine.admit(make_request("a", range(8), outputs=[50]))
    engine.schedule("a")
    engine.step()
    engine.finish("a")  # its last blocks queued for storing, not yet in a plan
    assert engine.scheduler.selector.queued, "the test needs a queued store"
    assert engine.scheduler.holds_gpu_blocks_alone()


def test_a_block_pinned_by_two_stores_and_no_request_counts() -> None:
    # Regression: the check took a block held alone by the transfers to have one
    # reference. A reset lets the keys of the stores it abandons go (`tier_reset`), so a
    # request admitted meanwhile stores its GPU prefix hit afresh: the same GPU blocks,
    # pinned by the abandoned store and the new one. Once that request finished, nothing
    # but the two stores held them, yet the check said no free was pending (an engine
    # short of blocks then preempted a request instead of waiting for the reports).
    engine = SimEngine(full_layout())
    old = engine.store_of_finished(make_request("old", range(8)))
    assert engine.scheduler.reset() is False
    again = make_request("again", [*range(8), 5])
    engine.admit(again)  # a GPU prefix hit on the blocks the abandoned store pins
    shared = [b for b in engine.tables["again"][0] if b in old.src_block_ids]
    assert shared, "the test needs the abandoned store's blocks in the new table"
    engine.schedule("again")
    (store,) = engine.step().jobs  # its computed blocks, the prefix hit's included
    assert set(shared) <= set(store.src_block_ids), "both stores pin the shared blocks"
    assert not engine.scheduler.holds_gpu_blocks_alone(), "the request holds them too"
    engine.finish("again")
    assert not engine.engine_refs(), "no request holds a block"
    assert all(engine.gpu.ref_count(b) == 2 for b in shared)
    assert engine.scheduler.holds_gpu_blocks_alone()
    engine.worker.complete(old.event_id)
    engine.poll()
    assert engine.scheduler.holds_gpu_blocks_alone(), "the new store holds them alone now"
    engine.worker.complete(store.event_id)
    engine.poll()
    assert not engine.scheduler.holds_gpu_blocks_alone()
    engine.check()
