"""`kvtier demo` holds one engine (one GPU pool) in memory at a time."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
from test_demo_cli_errors import run_demo

from kvtier.cli import demo
from kvtier.engine.llm import LLM


def test_each_run_frees_the_engine_before_the_next_builds_its_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the warm-up engine stayed referenced through every run and each run's
    engine until the next was built: three GPU pools at once (peak RSS 3.96 GB for a
    1.18 GB pool, 1.51 GB after)."""
    alive: weakref.WeakSet[LLM] = weakref.WeakSet()
    alive_at_build: list[int] = []

    class CountedLLM(LLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            alive_at_build.append(len(alive))
            super().__init__(*args, **kwargs)
            alive.add(self)

    monkeypatch.setattr(demo, "LLM", CountedLLM)
    assert run_demo(tmp_path, "--disk-io=page_cache") == 0
    assert len(alive_at_build) == 5  # the warm-up engine, then one per configuration
    assert alive_at_build == [0] * 5
