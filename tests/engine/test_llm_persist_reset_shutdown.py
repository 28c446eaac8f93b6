"""A reset followed by shutdown with no step in between still ends persistence.

Regression (review): the end of persistence reached the worker only on a later plan
(`TransferPlan.end_persistence`); an engine shut down right after `reset()` left the
records from before the reset, and a restart restored their blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_llm_persist_reset import ENGINE, MODEL, PARAMS, PROMPT, persistent, restart

from kvtier.engine.llm import LLM
from kvtier.offload.config import CascadeMode


@pytest.mark.parametrize(
    "cascade", [None, CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK], ids=str
)
def test_a_reset_then_shutdown_restores_nothing(
    tmp_path: Path, cascade: CascadeMode | None
) -> None:
    config = persistent(tmp_path, cascade)
    with LLM(MODEL, config, ENGINE) as llm:
        llm.generate([PROMPT], PARAMS)
        llm.drain()
        assert llm.offload.scheduler.reset()
        # no step: the engine shuts down at once
    _, restored = restart(config)
    assert restored == 0, "a reset's end of persistence never reached the worker"
