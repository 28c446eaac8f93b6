"""The scheduler role's translation rules, call by call (mutation run s30).

Each test pins one rule of `SchedulerSide` whose fault would hand kvtier another
request's tokens (wrong prefix, wrong KV) or misreport a hit, while vLLM's usual call
order (`vllm_harness`) still passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import kvtier_harness, scheduler_side
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata
from kvtier.adapters.vllm.scheduler_side import SchedulerSide
from kvtier.core.keys import make_key
from kvtier.offload.plan import Tier
from kvtier.offload.protocols import TableUpdate


@pytest.fixture
def side() -> Iterator[SchedulerSide]:
    harness = kvtier_harness()
    yield scheduler_side(harness)
    harness.close()


def request(request_id: str) -> Any:
    """Return a stand-in for a vLLM `Request` (the views read it lazily)."""
    return SimpleNamespace(request_id=request_id)


def capture_views(side: SchedulerSide, monkeypatch: Any, method: str, result: Any) -> list[Any]:
    """Make `side.offload.<method>` record the view it gets and return `result`."""
    views: list[Any] = []

    def record(view: Any, *args: Any) -> Any:
        views.append(view)
        return result

    monkeypatch.setattr(side.offload, method, record)
    return views


def test_a_request_id_used_again_gets_a_view_of_the_new_request(side: SchedulerSide) -> None:
    # A view kept for the old request object would hand kvtier the old request's tokens
    # (another prefix) under the new request's id.
    old, new = request("a"), request("a")
    assert side.add_request(old).request is old
    assert side.add_request(new).request is new
    assert side.add_request(new).request is new


def test_lookup_reads_the_request_it_is_given_not_an_older_one_of_that_id(
    side: SchedulerSide, monkeypatch: Any
) -> None:
    views = capture_views(side, monkeypatch, "lookup", 0)
    old, new = request("a"), request("a")
    side.add_request(old)
    assert side.lookup(new, 0) == (0, False)
    assert [view.request is new for view in views] == [True]


def test_on_allocated_hands_kvtier_the_request_it_is_given(
    side: SchedulerSide, monkeypatch: Any
) -> None:
    views = capture_views(side, monkeypatch, "on_allocated", {})
    old, new = request("a"), request("a")
    side.add_request(old)
    side.on_allocated(new, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert [view.request is new for view in views] == [True]


def test_the_pool_view_counts_each_group_s_tokens_with_its_own_block_size(
    side: SchedulerSide, monkeypatch: Any
) -> None:
    # A hybrid's groups may have blocks of different sizes: a view sized by the first
    # group's alone would count the 32 tokens of a group-1 block's key as 16.
    groups = [SimpleNamespace(block_size=16), SimpleNamespace(block_size=32)]
    monkeypatch.setattr(side, "layout", SimpleNamespace(groups=groups))
    views = capture_views(side, monkeypatch, "bind_gpu_pool", None)
    block = SimpleNamespace(block_hash=make_key(bytes(32), 1), block_hash_num_tokens=96)
    side.bind_gpu_block_pool(SimpleNamespace(blocks=[block]))
    assert [view.num_tokens(0) for view in views] == [32]


def test_a_hit_split_is_reported_once_for_the_request_and_tokens_just_allocated(
    side: SchedulerSide, monkeypatch: Any
) -> None:
    # vLLM asks right after `update_state_after_alloc`; any other question (another
    # request, other tokens, a second ask) gets None (the first tier takes the hit),
    # never the last allocation's split under another request's name.
    split = {Tier.CPU: 16, Tier.DISK: 32}
    capture_views(side, monkeypatch, "on_allocated", split)
    table = SimpleNamespace(get_block_ids=lambda: ([],))

    def allocate(request_id: str) -> None:
        side.on_allocated(request(request_id), table, 48)

    allocate("a")
    assert side.hit_split("a", 48) == split
    assert side.hit_split("a", 48) is None  # asked again
    allocate("a")
    assert side.hit_split("b", 48) is None  # another request's
    allocate("a")
    assert side.hit_split("a", 32) is None  # other tokens
    split[Tier.CPU] = 0
    allocate("a")
    assert side.hit_split("a", 32) == {Tier.DISK: 32}  # a tier serving nothing is left out


def test_a_load_dropped_before_issue_is_echoed_though_an_output_is_applied_first(
    side: SchedulerSide,
) -> None:
    # Dropped at allocation (no lookup pin), then an output applied before the next plan:
    # the drop is still echoed as a failed load, not taken for a worker's failure (no
    # worker ran it; its request would wait for the load for good).
    waiting = SimpleNamespace(request_id="a", num_computed_tokens=0)
    side.on_allocated(waiting, SimpleNamespace(get_block_ids=lambda: ([],)), 16)
    side.apply_output(KVConnectorOutput())
    metadata = side.build_metadata(SchedulerOutput.make_empty())
    assert metadata.unissued_failed_request_ids == ("a",)


def test_a_load_dropped_at_allocation_is_echoed_by_the_next_plan(side: SchedulerSide) -> None:
    # vLLM allocates in `schedule()` and builds that step's plan right after, with no
    # output applied between: the plan carries the drop (taken a plan later, vLLM would
    # hold the request's blocks a step longer for a load that never runs).
    waiting = SimpleNamespace(request_id="a", num_computed_tokens=0)
    side.on_allocated(waiting, SimpleNamespace(get_block_ids=lambda: ([],)), 16)
    metadata = side.build_metadata(SchedulerOutput.make_empty())
    assert metadata.unissued_failed_request_ids == ("a",)


def test_only_an_abort_while_an_exception_is_handled_leaves_compute_unconfirmed(
    side: SchedulerSide, monkeypatch: Any
) -> None:
    # The fault handler's aborts: their last step's compute may never have run. A request
    # that stopped normally, or an abort with no exception in flight, counts its compute.
    flags: list[bool] = []

    def finished(view: Any, block_ids: Any, computed: bool) -> bool:
        flags.append(computed)
        return False

    monkeypatch.setattr(side.offload, "on_finished", finished)
    stopped, aborted = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED
    for name, status in (("stopped", stopped), ("aborted", aborted)):
        try:
            raise RuntimeError("a fault")
        except RuntimeError:
            side.on_finished(SimpleNamespace(request_id=name, status=status), ([],))
    side.on_finished(SimpleNamespace(request_id="user-abort", status=aborted), ([],))
    assert flags == [True, False, True]


def test_finishes_during_a_plan_in_flight_are_unconfirmed_by_a_fault_only(
    monkeypatch: Any,
) -> None:
    # Requests finished while plan 1 awaits its outputs: a later normal finish leaves
    # them confirmed (their stores stand); the fault handler's abort unconfirms them.
    harness = kvtier_harness(async_scheduling=True, batch_queue_size=2)
    try:
        check_fault_only(scheduler_side(harness), monkeypatch)
    finally:
        harness.close()


def recorded_unconfirms(side: SchedulerSide, monkeypatch: Any) -> list[str]:
    """Stub the offload side's finishes; return the list `unconfirm_finished` fills."""
    monkeypatch.setattr(side.offload, "on_finished", lambda view, ids, computed: False)
    unconfirmed: list[str] = []
    monkeypatch.setattr(
        side.offload, "unconfirm_finished", lambda view, tables: unconfirmed.append(view.request_id)
    )
    return unconfirmed


def check_fault_only(side: SchedulerSide, monkeypatch: Any) -> None:
    unconfirmed = recorded_unconfirms(side, monkeypatch)
    side.build_metadata(SchedulerOutput.make_empty())
    stopped, aborted = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED
    for name in ("a", "b"):
        side.on_finished(SimpleNamespace(request_id=name, status=stopped), ([1],))
    assert unconfirmed == []
    try:
        raise RuntimeError("a fault")
    except RuntimeError:
        side.on_finished(SimpleNamespace(request_id="c", status=aborted), ([2],))
    assert unconfirmed == ["a", "b"]


def test_a_finish_after_every_plans_outputs_came_stays_confirmed_through_a_later_fault(
    monkeypatch: Any,
) -> None:
    # Plan 1's outputs were all applied before the request stopped: no forward in flight
    # can have counted compute that never ran, so the next step's fault leaves its
    # finish confirmed (unconfirming it would drop its store for nothing).
    harness = kvtier_harness(async_scheduling=True, batch_queue_size=2)
    try:
        side = scheduler_side(harness)
        unconfirmed = recorded_unconfirms(side, monkeypatch)
        step = side.build_metadata(SchedulerOutput.make_empty()).plan.step_id
        output = KVTierWorkerMetadata(steps={0: step})
        side.apply_output(KVConnectorOutput(kv_connector_worker_meta=output))
        stopped, aborted = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED
        side.on_finished(SimpleNamespace(request_id="a", status=stopped), ([1],))
        try:
            raise RuntimeError("a fault")
        except RuntimeError:
            side.on_finished(SimpleNamespace(request_id="c", status=aborted), ([2],))
        assert unconfirmed == []
    finally:
        harness.close()


def test_a_finish_stays_suspect_while_a_later_plan_awaits_its_outputs(
    monkeypatch: Any,
) -> None:
    # Plan 2 is in flight when "a" stops; plan 1's outputs then arrive: only finishes
    # before plan 1's end are confirmed, so plan 2's fault (the handler's abort) still
    # unconfirms a (confirmed, its store could hold KV of a forward that never ran).
    harness = kvtier_harness(async_scheduling=True, batch_queue_size=2)
    try:
        side = scheduler_side(harness)
        unconfirmed = recorded_unconfirms(side, monkeypatch)
        first = side.build_metadata(SchedulerOutput.make_empty()).plan.step_id
        side.build_metadata(SchedulerOutput.make_empty())
        stopped, aborted = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED
        side.on_finished(SimpleNamespace(request_id="a", status=stopped), ([1],))
        output = KVTierWorkerMetadata(steps={0: first})
        side.apply_output(KVConnectorOutput(kv_connector_worker_meta=output))
        try:
            raise RuntimeError("a fault")
        except RuntimeError:
            side.on_finished(SimpleNamespace(request_id="c", status=aborted), ([2],))
        assert unconfirmed == ["a"]
    finally:
        harness.close()


def test_worker_metadata_of_another_kind_is_refused(side: SchedulerSide) -> None:
    # Read as "nothing finished", it would leave every load kvtier issued waiting for
    # good (vLLM waits for its request), and every store and pin held.
    with pytest.raises(TypeError, match="unexpected worker metadata"):
        side.apply_output(KVConnectorOutput(kv_connector_worker_meta=object()))


def test_each_step_hands_kvtier_vllms_full_tables_and_finishes() -> None:
    # A new request's blocks are its whole table (REPLACE): only there does kvtier look
    # for prefix hits on blocks whose KV is unconfirmed or held back, which it must not
    # store; later steps append. The step's finished requests end their hand-offs.
    harness = kvtier_harness()
    try:
        offload = scheduler_side(harness).offload
        build = offload.build_plan
        steps: list[Any] = []

        def recorded(step: Any) -> Any:
            steps.append(step)
            return build(step)

        offload.build_plan = recorded  # type: ignore[method-assign]
        harness.run_requests({"a": list(range(1000, 1040))}, max_tokens=3)
        updates = [s.table_update for step in steps for s in step.scheduled]
        assert updates == [TableUpdate.REPLACE, TableUpdate.APPEND, TableUpdate.APPEND]
        finishes = [set(step.finished_request_ids) for step in steps]
        assert [f for f in finishes if f] == [{"a"}], finishes
    finally:
        harness.close()


def test_a_disk_tiers_hit_without_a_split_is_a_disk_hit(tmp_path: Any) -> None:
    # No split for the request (vLLM asked of another allocation): the configured tier's
    # source is reported, not the CPU's.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    disk = {"cpu_bytes": 0, "disk_bytes": 1 << 22, "disk_path": str(tmp_path)}
    harness = kvtier_harness(extra={**disk, "disk_io_mode": "page_cache"})
    try:
        connector: Any = harness.scheduler.connector
        hits = connector.get_external_cache_hit_sources(request("a"), 16)
        assert hits == {CacheHitSource.DISK: 16}
    finally:
        harness.close()
