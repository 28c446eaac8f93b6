"""A request id used again while a load of its earlier request is still in flight.

SPEC §6.7: a load issued for a request that finishes keeps its pins until the workers
report it. Its outcome is nobody's by then: a request admitted since under the same id
(an engine whose ids repeat) must not take it. Before, the earlier load's completion was
returned as the new request's finished load while the new load still copied into its
blocks (the engine computed from KV not loaded yet), and its failure was returned as the
new request's failed load (rewound mid-load, then held back as a failed recompute).
"""

from __future__ import annotations

from sim import Admission, SimEngine, SimRequest, config, full_layout, make_request

from kvtier.offload.plan import TransferJob


def _reused_while_loading() -> tuple[SimEngine, TransferJob, TransferJob, SimRequest]:
    """Return an engine whose "b" finished while loading, a new "b" admitted to load the
    same prefix, the old and new load jobs (both in flight), and the new request."""
    engine = SimEngine(full_layout(), config())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    assert engine.admit(make_request("b", [*range(8), 99])) == Admission(0, 8, 8)
    (old_load,) = engine.step().jobs
    engine.finish("b")
    again = make_request("b", [*range(8), 98])
    assert engine.admit(again) == Admission(0, 8, 8)
    (new_load,) = engine.step().jobs
    assert new_load.is_load
    assert new_load.event_id != old_load.event_id
    return engine, old_load, new_load, again


def test_an_earlier_requests_finished_load_is_not_the_new_requests() -> None:
    engine, old_load, new_load, again = _reused_while_loading()
    engine.worker.complete(old_load.event_id)
    outcome = engine.poll()  # SimEngine checks the KV of a request it is told is loaded
    assert outcome.finished_loads == ()
    assert "b" in engine.loading
    engine.check()
    engine.worker.complete(new_load.event_id)
    assert engine.poll().finished_loads == ("b",)
    engine.schedule("b")
    engine.step()  # the forward pass checks every block it reads
    assert again.num_computed_tokens == again.num_tokens
    engine.check()


def test_an_earlier_requests_failed_load_does_not_rewind_the_new_request() -> None:
    engine, old_load, new_load, again = _reused_while_loading()
    engine.worker.fail(old_load.event_id)
    outcome = engine.poll()
    assert outcome.failed_loads == ()
    assert again.num_computed_tokens == 8
    assert "b" not in engine.scheduler.loads.recompute_next
    engine.check()
    engine.worker.complete(new_load.event_id)
    assert engine.poll().finished_loads == ("b",)
    engine.schedule("b")
    engine.step()
    engine.check()


def test_a_finished_requests_load_still_releases_its_pins_and_counts_its_blocks() -> None:
    """The outcome goes to no one; the pins go and the copied blocks count as before."""
    engine, old_load, new_load, _ = _reused_while_loading()
    engine.worker.complete(old_load.event_id)
    engine.worker.complete(new_load.event_id)
    engine.poll()
    stats = engine.scheduler.take_stats()
    assert stats.num_loaded_blocks == 4  # 2 blocks by each load
    assert stats.hit_tokens == {"CPU": 8}  # the new request's hit only
    engine.finish("b")
    engine.drain()
    tier = engine.scheduler.tier_pool
    assert tier.num_free() == tier.num_usable_blocks
    engine.check()


def test_a_finished_requests_load_failed_before_issue_is_not_the_new_requests() -> None:
    """A load that failed before issue (more accepted than the lookup offered) and whose
    request finished before the next report: `on_finished` says it dropped a load never
    issued (vLLM's adapter echoes it), and the next report does not fail the new request
    of that id, whose load is in flight (it was rewound and held back to recompute)."""
    engine = SimEngine(full_layout(), config())
    engine.run(make_request("a", range(8)))
    engine.drain()
    engine.evict_gpu()
    engine.auto_complete = False
    b = make_request("b", [*range(12), 99])
    found = engine.lookup(b)
    assert engine.allocate(b, found, accept=12) == Admission(0, 8, 12)  # fails unissued
    returned: list[bool] = []
    on_finished = engine.scheduler.on_finished
    engine.scheduler.on_finished = lambda *args, **kw: returned.append(on_finished(*args, **kw))  # type: ignore[method-assign]
    engine.finish("b")
    assert returned == [True]  # no report names it now
    engine.scheduler.on_finished = on_finished  # type: ignore[method-assign]
    assert not engine.scheduler.has_unissued_failures()
    again = make_request("b", [*range(8), 98])
    assert engine.admit(again) == Admission(0, 8, 8)
    (new_load,) = engine.step().jobs
    assert engine.outcomes[-1].failed_loads == ()
    assert again.num_computed_tokens == 8
    assert "b" not in engine.scheduler.loads.recompute_next
    engine.worker.complete(new_load.event_id)
    assert engine.poll().finished_loads == ("b",)
    engine.check()
