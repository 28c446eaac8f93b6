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
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
