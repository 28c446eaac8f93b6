"""The guard of tests/conftest.py: a test that leaves an offload worker to the garbage
collector fails at its teardown, unless marked `drops_workers` (worker_drops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

INNER_TESTS = """
import pytest
import torch

from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.regions import TensorLayout


def started_worker():
    worker = OffloadWorker(WorkerConfig(cpu_num_slots=4))
    worker.register([torch.zeros((2, 4, 16, 2, 16), dtype=torch.float16)], TensorLayout.KV_FIRST)
    return worker


class Cycle:  # dropped only by a garbage collection, as a harness is
    def __init__(self):
        self.me = self
        self.worker = started_worker()


def test_drops_a_worker():
    Cycle()


@pytest.mark.drops_workers
def test_drops_a_worker_on_purpose():
    Cycle()


def test_shuts_its_worker_down():
    Cycle().worker.shutdown()
"""


@pytest.mark.drops_workers  # its inner tests' (two of them on purpose)
def test_a_worker_left_to_the_garbage_collector_fails_the_test(pytester: pytest.Pytester) -> None:
    here = Path(__file__).parent
    pytester.makeconftest((here / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    drops_workers: on purpose\n")
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_drops_a_worker*",
            "*1 offload worker(s) left to the garbage collector*rank 0 dropped without*",
        ]
    )
