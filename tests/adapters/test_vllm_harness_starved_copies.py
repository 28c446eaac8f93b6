"""The harness's drains wait for the workers' copies instead of spinning out their step cap.

Regression (a flake, seen once in `test_a_gauge_only_change_is_reported`: "engine still
busy after 2000 steps"): an idle step of the harness's engine loop takes well under a
millisecond, so a drain's step cap was about a second of spinning; a copy thread that a
loaded machine did not run for that long failed the drain although nothing hung. Here a
copy thread is held back until the engine loop next waits for the copies (as a starved
thread runs once the busy loop lets go of the CPU), so a drain passes only if it waits.
The same holds for the hand-written step loops over real workers (test_vllm_mamba's,
test_vllm_partial_load_failure's, test_vllm_partial_load_races'): they step with
`VllmHarness.drain_step`. Loops over a `FaultyWorker` (random_ops_driver, and the loops
of test_vllm_multi_connector and test_vllm_priority) never depended on a copy thread's
speed: each of its polls waits for the copies started.
"""

from __future__ import annotations

import collections
import pathlib
import threading
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("vllm")

import random_ops_driver
from kvtier_vllm import drain_collecting_stats, kvtier_harness
from random_ops import Add, Drain, Engine, Reset
from random_ops_driver import Run
from test_vllm_mamba import mamba_harness, run_checked
from test_vllm_partial_load_failure import serve
from test_vllm_partial_load_races import run, store_two_prefixes
from vllm_harness import VllmHarness

from kvtier.transfer.lanes import TransferLane
from kvtier.transfer.worker import OffloadWorker

PROMPT = list(range(1000, 1041))


@pytest.fixture
def starved(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hold every copy job until someone next waits for the workers' copies (`flush`)."""
    flushes = [0]  # how many waits began
    changed = threading.Condition()
    submit, flush = TransferLane.submit, OffloadWorker.flush

    def held_submit(lane: TransferLane, event_id: int, job: object) -> None:
        submitted = flushes[0]

        def held() -> object:
            with changed:
                changed.wait_for(lambda: flushes[0] > submitted)
            return job()  # type: ignore[operator]

        submit(lane, event_id, held)

    def releasing_flush(worker: OffloadWorker) -> None:
        with changed:
            flushes[0] += 1
            changed.notify_all()
        flush(worker)

    monkeypatch.setattr(TransferLane, "submit", held_submit)
    monkeypatch.setattr(OffloadWorker, "flush", releasing_flush)
    yield
    with changed:  # a failed drain leaves jobs held: let them finish
        flushes[0] = 1 << 62
        changed.notify_all()


def stores_then_loads(harness: VllmHarness, drain: Callable[[VllmHarness], object]) -> None:
    """Store a request's 2 full blocks, then load them back for another."""
    harness.add_request("a", PROMPT, max_tokens=2)
    drain(harness)
    assert harness.scheduler.reset_prefix_cache()
    harness.add_request("b", [*PROMPT, 7], max_tokens=2)
    drain(harness)
    assert harness.external_hit_tokens("b") == 32


def test_run_waits_for_starved_copies(starved: None) -> None:
    harness = kvtier_harness()
    # Failed: "engine still busy after 100 steps".
    stores_then_loads(harness, lambda h: h.run(max_steps=100))
    harness.close()


def test_drain_collecting_stats_waits_for_starved_copies(starved: None) -> None:
    harness = kvtier_harness()
    payloads: list[object] = []
    # Failed: "engine still busy after 100 steps".
    stores_then_loads(harness, lambda h: payloads.extend(drain_collecting_stats(h, 100)))
    assert payloads
    harness.close()


def test_the_random_ops_drain_does_not_depend_on_starved_copies(
    starved: None, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Passed on the old driver too (no regression): `FaultyWorker.poll` waits for the
    # copies started, so its drains count polls, not a copy thread's time.
    monkeypatch.setattr(random_ops_driver, "MAX_DRAIN_STEPS", 100)
    run = Run(Engine("eager"), collections.Counter(), str(tmp_path))
    for op in [Add(1, 0, 2, 5, 0, 2), Drain(), Reset("gpu"), Add(1, 0, 2, 5, 1, 2), Drain()]:
        run.apply(op)
    run.finish(abort=False)
    assert run.harness.external_hit_tokens("r1") == 32
    run.close()


def test_mamba_run_checked_waits_for_starved_copies(starved: None) -> None:
    # Failed: "engine still busy after 2000 steps".
    harness = mamba_harness()
    run_checked(harness, {"a": PROMPT})
    assert harness.scheduler.reset_prefix_cache()
    run_checked(harness, {"b": [*PROMPT, 7]})
    assert harness.external_hit_tokens("b") > 0
    harness.close()


def test_partial_load_failure_serve_waits_for_starved_copies(
    starved: None, tmp_path: pathlib.Path
) -> None:
    # Failed: "assert not True" (`not harness.is_busy()` after its 2000 steps).
    harness, computed, _, _ = serve(tmp_path, 1, None)
    assert len(computed) == 2  # both prompts again
    assert all(n > 0 for n in computed.values())  # loaded from the disk tier
    harness.close()


def test_partial_load_races_run_waits_for_starved_copies(
    starved: None, tmp_path: pathlib.Path
) -> None:
    # Failed: "assert not True" (`not harness.is_busy()` after its 3000 steps).
    harness, prompts = store_two_prefixes(tmp_path)
    for request_id, prompt in prompts.items():
        harness.add_request(f"again-{request_id}", [*prompt, 9], max_tokens=3)
    computed, _, _ = run(harness)
    assert {f"again-{r}" for r in prompts} <= harness.finished
    assert all(computed[f"again-{r}"] > 0 for r in prompts)
    harness.close()
