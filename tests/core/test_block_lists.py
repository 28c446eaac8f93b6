"""`BlockLists` (the policies' intrusive lists): the cursor errors its docstrings promise,
its list-count bound, and the link corruptions `check_invariants` refuses (a mutation run
found each of these untested: every test fails when its rule or check is dropped)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.core.policies.block_lists import BlockLists


def _lists() -> BlockLists:
    """Blocks 0..5: list 0 = [1, 2, 3], list 1 = [4]; blocks 0 and 5 in no list."""
    lists = BlockLists(6, 2)
    for block_id in (1, 2, 3):
        lists.push_tail(0, block_id)
    lists.push_tail(1, 4)
    lists.check_invariants()
    return lists


@pytest.mark.parametrize("num_lists", [0, 128])
def test_a_number_of_lists_outside_1_to_127_is_refused(num_lists: int) -> None:
    """List ids are int8 labels (-1 marks a block in no list); the bound is documented."""
    with pytest.raises(ValueError, match=r"num_lists must be in \[1, 127\]"):
        BlockLists(4, num_lists)


def test_iter_lists_after_refuses_a_cursor_queued_in_a_list_outside_the_order() -> None:
    """Block 4 is queued, but in list 1, which the order [0] leaves out."""
    lists = _lists()
    assert list(lists.iter_lists_after([0, 1], 2)) == [3, 4]
    with pytest.raises(KeyError, match="block 4 is not queued"):
        list(lists.iter_lists_after([0], 4))


def test_after_cursor_refuses_a_cursor_in_no_list() -> None:
    """Without the check, an unqueued cursor consumed the whole order and yielded none."""
    lists = _lists()
    assert list(lists.after_cursor(iter([4, 1, 2, 3]), 1)) == [2, 3]
    with pytest.raises(KeyError, match="block 5 is not queued"):
        lists.after_cursor(iter([4, 1, 2, 3]), 5)


def _break_back_link(lists: BlockLists) -> None:
    lists._prev[2] = 3  # 1 -> 2, but 2 points back to 3


def _break_tail_link(lists: BlockLists) -> None:
    lists._prev[6] = 2  # list 0's sentinel (node 6) names 2 its tail, not 3


def _label_an_unlisted_block(lists: BlockLists) -> None:
    lists._where[5] = 1  # block 5 says list 1, which does not link it


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_break_back_link, "broken back link at 2"),
        (_break_tail_link, "tail link broken"),
        (_label_an_unlisted_block, "labelled with a list it is not linked in"),
    ],
)
def test_check_refuses_links_and_labels_that_disagree(
    corrupt: Callable[[BlockLists], None], message: str
) -> None:
    lists = _lists()
    corrupt(lists)
    with pytest.raises(AssertionError, match=message):
        lists.check_invariants()
