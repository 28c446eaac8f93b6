"""`valid_prefix`: what a request keeps after a failed load (docs/load_failures.md)."""

from __future__ import annotations

import pytest

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.load_failure import valid_prefix
from kvtier.engine.offload_side import _joined
from kvtier.offload.transfers import FailedLoad, ReportOutcome

SINGLE = KVLayout.single(4, 64)
TABLE = [[7, 8, 20, 21, 22, 23]]  # 8 local tokens in blocks 7, 8; 16 loaded into 20..23
FAILED = FailedLoad("r", 8, 24)


@pytest.mark.parametrize(
    ("suspects", "keep"),
    [((22,), 16), ((23, 21), 12), ((20, 21, 22, 23), 8), ((20,), 8)],
)
def test_the_prefix_before_the_first_suspect_block_is_kept(
    suspects: tuple[int, ...], keep: int
) -> None:
    assert valid_prefix(SINGLE, TABLE, FAILED, suspects) == keep


@pytest.mark.parametrize(
    "suspects", [None, (), (99,), (22, 99)], ids=["unissued", "empty", "foreign", "mixed"]
)
def test_unknown_or_foreign_suspects_keep_nothing(suspects: tuple[int, ...] | None) -> None:
    assert valid_prefix(SINGLE, TABLE, FAILED, suspects) == 0


def test_a_hybrid_layout_keeps_nothing() -> None:
    """A sliding window at a shorter prefix needs blocks the load never wrote."""
    hybrid = KVLayout(
        (
            KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64),
            KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, sliding_window=8),
        )
    )
    assert valid_prefix(hybrid, [*TABLE, [0, 0, 30, 31, 32, 33]], FAILED, (22,)) == 0
    window = KVLayout((KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, sliding_window=8),))
    assert valid_prefix(window, TABLE, FAILED, (22,)) == 0


def test_a_suspect_at_or_past_the_loads_end_keeps_nothing() -> None:
    """Only a prefix ending inside the failed load's tokens is kept: a suspect block
    at the load's end (block 23 holds tokens [20, 24) of a load of [8, 20)) keeps
    nothing rather than all the load's tokens."""
    assert valid_prefix(SINGLE, TABLE, FailedLoad("r", 8, 20), (23,)) == 0


def test_a_suspect_in_the_local_prefix_keeps_nothing() -> None:
    """A suspect block before the load's first token (block 8 holds local tokens
    [4, 8)) is not one the load wrote: the report is not trusted, nothing is kept."""
    assert valid_prefix(SINGLE, TABLE, FAILED, (8,)) == 0


def test_outcomes_joined_across_polls_keep_each_loads_suspects() -> None:
    """Outcomes the engine has not applied yet are joined into one (`unapplied_outcome`):
    each failed load keeps its suspect blocks, so its request still keeps its valid
    prefix (without them, `valid_prefix` keeps nothing and it recomputes from 0)."""
    later = FailedLoad("q", 0, 8)
    joined = _joined(
        [
            ReportOutcome(("p",), (FAILED,), {"r": (22,)}),
            ReportOutcome((), (later,), {"q": (5,)}),
        ]
    )
    assert joined == ReportOutcome(("p",), (FAILED, later), {"r": (22,), "q": (5,)})
    assert valid_prefix(SINGLE, TABLE, FAILED, joined.suspect_gpu_blocks.get("r")) == 16
