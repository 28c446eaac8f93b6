"""The harness's drains wait for the workers' copies instead of spinning out their step cap.

Regression (a flake, seen once in `test_a_gauge_only_change_is_reported`: "engine still
busy after 2000 steps"): an idle step of the harness's engine loop takes well under a
millisecond, so a drain's step cap was about a second of spinning; a copy thread that a
loaded machine did not run for that long failed the drain although nothing hung. Here a
copy thread is held back until the engine loop waits for the copies (as a starved thread
runs once the busy loop lets go of the CPU), so a drain passes only if it waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import drain_collecting_stats, kvtier_harness
from vllm_harness import VllmHarness

from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.worker import OffloadWorker

PROMPT = list(range(1000, 1041))


@pytest.fixture
def starved(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every copy job until someone waits for the workers' copies (`flush`)."""
    runs = threading.Event()
    submit, flush = TransferLane.submit, OffloadWorker.flush

    def held_submit(lane: TransferLane, event_id: int, job: object) -> None:
        def held() -> object:
            runs.wait()
            return job()  # type: ignore[operator]

        submit(lane, event_id, held)

    def releasing_flush(worker: OffloadWorker) -> None:
        runs.set()
        flush(worker)

    monkeypatch.setattr(TransferLane, "submit", held_submit)
    monkeypatch.setattr(OffloadWorker, "flush", releasing_flush)
    yield runs
    runs.set()  # a failed drain leaves jobs held: let them finish


def stores_then_loads(harness: VllmHarness, drain: Callable[[VllmHarness], object]) -> None:
    """Store a request's 2 full blocks, then load them back for another."""
    harness.add_request("a", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("b") == 32


def test_run_waits_for_starved_copies(starved: threading.Event) -> None:
    harness = kvtier_harness()
    # Failed: "engine still busy after 100 steps".
    stores_then_loads(harness, lambda h: h.run(max_steps=100))
    harness.close()


def test_drain_collecting_stats_waits_for_starved_copies(starved: threading.Event) -> None:
    harness = kvtier_harness()
    payloads: list[object] = []
    # Failed: "engine still busy after 100 steps".
    stores_then_loads(harness, lambda h: payloads.extend(drain_collecting_stats(h, 100)))
    assert payloads
    harness.close()
