"""Test-wide hygiene: every test starts with the process's SIGINT and SIGTERM handlers.

`kvtier.replay.signals.signals_deferred` wraps them for good on first use (by design:
see that module), and a command's `sigterm_unwinds` puts back whatever it found; without
this, which handler a test sees would depend on the tests that ran before it.

Torch runs on one intra-op thread: the tests' models and tensors are tiny, and on a busy
machine (more runnable threads than cores) torch's worker threads wait for each other on
every operation, so a test took 7x (two busy processes beside it) to 100x as long and
tripped the 300 s timeout.

The Hugging Face hub is offline for the whole run (set before any test module imports
transformers, which reads it at import): no test downloads, and none sees it set or not
depending on which tests ran before it.

Every test shuts down the offload workers it builds: one that leaves one to the garbage
collector fails at its teardown (worker_drops.py), unless marked `drops_workers`.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator

import pytest
import torch

from worker_drops import DropRecorder, freeze_imported_objects, workers_pending

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="session", autouse=True)
def _imports_frozen() -> None:
    freeze_imported_objects()  # after collection: every test module is imported


@pytest.fixture(autouse=True)
def _workers_shut_down(request: pytest.FixtureRequest) -> Iterator[None]:
    on_purpose = request.node.get_closest_marker("drops_workers") is not None
    num_failed = request.session.testsfailed
    with DropRecorder() as recorder:
        yield
        if workers_pending():  # release what the test dropped now, not in a later test
            gc.collect()
    # A failed test skipped its shutdowns: its failure says enough.
    if recorder.dropped and not on_purpose and request.session.testsfailed == num_failed:
        pytest.fail(
            f"{len(recorder.dropped)} offload worker(s) left to the garbage collector"
            f" (shut down what the test builds): {recorder.dropped[0]}",
            pytrace=False,
        )
