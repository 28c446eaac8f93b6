"""Rules of `redelivery` that vLLM's usual call order does not reach (mutation run s35):
what counts as an output to number, how one worker's entries of two salvaged outputs
merge, and which step each worker's applied outputs count for."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.adapters.vllm.redelivery import Outbox, Output, Receipts, merge_sent


@pytest.mark.parametrize(
    "output",
    [
        Output(1, finished_recving=frozenset({"a"})),
        Output(1, failed_recving=frozenset({"a"})),
        Output(1, invalid_blocks=frozenset({7})),
    ],
    ids=["finished", "failed", "suspect blocks"],
)
def test_an_output_handing_vllm_anything_is_numbered(output: Output) -> None:
    """An output whose report is empty but which hands vLLM a finished or failed load, or
    suspect blocks, is numbered: dropped unnumbered, it would never be sent again and
    vLLM would wait for that load for good, or read KV never loaded (s35 RD1-RD3)."""
    assert not output.is_empty
    outbox = Outbox()
    assert outbox.record(output) == {outbox.worker_id: (1, (1,))}


def test_one_worker_s_two_entries_merge_to_the_later_step_whichever_comes_first() -> None:
    """A salvaged output and the next step's, of one worker, in either order: the
    merged entry names the later step and every number (s35 RD6, RD8)."""
    older, newer = {7: (4, (2,))}, {7: (5, (3,))}
    assert merge_sent(older, newer) == {7: (5, (2, 3))}
    assert merge_sent(newer, older) == {7: (5, (3, 2))}
    assert merge_sent(older, {8: (5, ())}) == {7: (4, (2,)), 8: (5, ())}


def test_an_older_step_of_a_worker_applied_late_does_not_lower_its_step() -> None:
    """Worker 7's output of step 6 was applied, then one of step 5 (a salvaged one);
    once worker 8's step 7 comes, every worker's outputs through step 6 are applied
    (s35 RD29)."""
    receipts = Receipts(num_workers=2)
    receipts.note_steps({7: 6})
    receipts.note_steps({7: 5})
    receipts.note_steps({8: 7})
    assert receipts.processed_step == 6
