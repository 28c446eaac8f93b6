"""The scheduler's block arithmetic (`kvtier.engine.block_counts`) on exact small cases.

Found by a mutation run (s30): counting the blocks `num_tokens` hold with a floor
instead of a ceiling, a negative count for a table already longer than needed, and a
chunk of one token for a request asking none all left the engine's tests passing (they
only make admission more or less conservative there).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.block_counts import most_that_fit, num_blocks_after, num_new_blocks

FULL = KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64)
SLIDING = KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, sliding_window=8)
LAYOUT = KVLayout((FULL, SLIDING))


def _request(num_computed: int, table_lengths: tuple[int, int]) -> Any:
    return SimpleNamespace(
        num_computed_tokens=num_computed, block_tables=[[7] * n for n in table_lengths]
    )


def test_num_blocks_after_counts_only_the_blocks_opened() -> None:
    assert num_blocks_after(LAYOUT, 5, 2) == 0  # tokens 5 and 6 fit block 1, open already
    assert num_blocks_after(LAYOUT, 5, 4) == 2  # the 9th token opens block 2 in each group
    assert num_blocks_after(LAYOUT, 8, 1) == 2
    assert num_blocks_after(LAYOUT, 0, 9) == 2 * 3


def test_num_new_blocks_never_counts_below_zero() -> None:
    # Back from a load, a table may hold more blocks than the next chunk needs.
    assert num_new_blocks(LAYOUT, _request(0, (3, 3)), 1) == 0
    assert num_new_blocks(LAYOUT, _request(0, (3, 0)), 1) == 1  # the other group's
    assert num_new_blocks(LAYOUT, _request(4, (1, 1)), 5) == 2 * 2


def test_most_that_fit_asks_nothing_for_no_tokens() -> None:
    assert most_that_fit(0, lambda n: True) is None
    assert most_that_fit(5, lambda n: n <= 3) == 3
    assert most_that_fit(5, lambda n: False) is None
