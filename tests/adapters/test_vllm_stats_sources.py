"""The process-wide registry of stats sources (`kvtier.adapters.vllm.stats`), read by
every kvtier scheduler role each step it sends stats (`live_sources`, for its siblings'
gauges) while engines in other threads of the process may claim or release numbers.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier.adapters.vllm import stats
from kvtier.adapters.vllm.stats import (
    claim_source,
    is_sole_source,
    live_sources,
    release_source,
)


class Owner:
    """A connector's stand-in (weak references need a class)."""


def test_live_sources_survives_claims_made_while_it_reads() -> None:
    """Another thread may run between any two lines of `live_sources` (the GIL switches
    there): a trace function stands in for it, claiming a source at each line run inside
    `live_sources` (its own frames and those it calls). Regression: it iterated the weak
    registry in Python, so a claim meanwhile raised `RuntimeError: dictionary changed
    size during iteration` out of the engine's step."""
    owners = [Owner() for _ in range(3)]
    sources = [claim_source(owner) for owner in owners]
    intruders: list[tuple[str, Owner]] = []  # claimed "from another thread"

    def intrude(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and len(intruders) < 20:
            intruder = Owner()
            intruders.append((claim_source(intruder), intruder))
        return intrude

    depth = 0

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal depth
        if frame.f_code is live_sources.__code__:
            depth += 1
        return intrude if depth else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        found = dict(live_sources())
    finally:
        sys.settrace(previous)
        for source, intruder in intruders:
            release_source(source, intruder)
    assert intruders  # the stand-in ran inside `live_sources`
    for source, owner in zip(sources, owners, strict=True):
        assert found[source] is owner  # every owner live before the call is listed
    for source, owner in zip(sources, owners, strict=True):
        release_source(source, owner)


def test_sole_source_only_while_no_other_number_is_claimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connector alone skips its siblings' scan (`is_sole_source`); a second claim, or
    a dead owner's number not yet reused, sends it down the full scan."""
    monkeypatch.setattr(stats, "_SOURCES", {})  # other tests' dead claims stay otherwise
    first = Owner()
    source = claim_source(first)
    try:
        assert is_sole_source(first)
        assert not is_sole_source(Owner())
        second = Owner()
        other = claim_source(second)
        assert not is_sole_source(first)
        assert not is_sole_source(second)
        release_source(other, second)
        assert is_sole_source(first)
        dead = Owner()
        claim_source(dead)
        del dead  # its number stays claimed until reused: not alone, by the cheap test
        assert not is_sole_source(first)
        assert [owner for _, owner in live_sources()] == [first]
    finally:
        release_source(source, first)
    assert not is_sole_source(first)
