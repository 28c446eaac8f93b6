"""Outcomes of several polls the engine has not applied yet are returned as one.

An interrupt before the engine applied a poll's outcome leaves it to the next poll,
which joins them (`OffloadSide.unapplied_outcome`): every finished and failed load in
order, and the suspect GPU blocks of each failed one. Without its suspects, a failed
load keeps none of its request's valid prefix (`valid_prefix`): it recomputes it all.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import OffloadConfig
from kvtier.offload.transfers import FailedLoad, ReportOutcome


def test_outcomes_of_polls_not_applied_are_joined_with_their_suspects() -> None:
    engine = EngineConfig(block_size=4, num_gpu_blocks=16)
    with LLM(None, kv_offload=OffloadConfig(cpu_bytes=1 << 22), engine=engine) as llm:
        side = llm.offload
        assert side is not None
        outcomes: Iterator[ReportOutcome] = iter(
            [
                ReportOutcome(("a",), (FailedLoad("b", 4, 12),), {"b": (7,)}),
                ReportOutcome(("c",), (FailedLoad("d", 0, 8),), {"d": (3, 5)}),
            ]
        )
        side.scheduler.apply_report = lambda report: next(outcomes)  # type: ignore[method-assign]
        assert side.poll() == ReportOutcome(("a",), (FailedLoad("b", 4, 12),), {"b": (7,)})
        # Not applied (an interrupt): the next poll returns both.
        joined = side.poll()
        assert joined.finished_loads == ("a", "c")
        assert joined.failed_loads == (FailedLoad("b", 4, 12), FailedLoad("d", 0, 8))
        assert dict(joined.suspect_gpu_blocks) == {"b": (7,), "d": (3, 5)}
        assert side.has_unapplied_outcome()
        side.outcome_applied()
        assert not side.has_unapplied_outcome()
        del side.scheduler.apply_report
        assert side.poll() == ReportOutcome()
