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
