"""`valid_prefix`: what a request keeps after a failed load (docs/load_failures.md)."""

from __future__ import annotations

import pytest

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.load_failure import valid_prefix
from kvtier.offload.transfers import FailedLoad

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
