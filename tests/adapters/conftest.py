"""Every `VllmHarness` a test builds is closed at its teardown at the latest: its workers
shut down (transfer threads stopped, tiers released) before the next test starts.

Module-scoped fixtures' harnesses, built before the test, are left to their fixture.

A test that changes vLLM's shared `EMPTY_MODEL_RUNNER_OUTPUT` fails at its teardown
(which puts it back): every later test in that process would have aggregated its empty
replies with what was left in it. `KVOutputAggregator.aggregate` writes the aggregate
into its output rank's reply, and `ModelRunnerOutput.with_kv_conn_output_only` hands
back the shared one for an empty output; in vLLM each reply is the engine core's own,
deserialized (`forward_faults.rank_reply` builds one so).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator

import pytest
from open_harnesses import OPEN, close_opened_since


@pytest.fixture(autouse=True)
def _harnesses_closed() -> Iterator[None]:
    before = list(OPEN)
    yield
    close_opened_since(before)


@pytest.fixture(autouse=True)
def _vllm_empty_output_unchanged() -> Iterator[None]:
    outputs = sys.modules.get("vllm.v1.outputs")  # None without vLLM (the main venv)
    if outputs is None:
        yield
        return
    shared = vars(outputs.EMPTY_MODEL_RUNNER_OUTPUT)
    before = copy.deepcopy(shared)
    yield
    changed = sorted(k for k in shared.keys() | before.keys() if shared.get(k) != before.get(k))
    if changed:
        shared.clear()
        shared.update(before)
        pytest.fail(f"the test changed vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT: {changed}")
