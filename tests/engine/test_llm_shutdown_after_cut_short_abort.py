"""`LLM.shutdown` right after an abort that a Ctrl-C cut short, no step between.

Regression: `drain` steps only while finish-time stores are pending, so the next step's
`_settle`, which ends such an abort, never ran: the request stayed RUNNING, unfinished,
holding its GPU blocks and its offload state, and the finish-time stores its abort
queues (its computed blocks, not planned yet) never reached the tier. Now the shutdown
first ends the abort (`Scheduler.end_aborts`), as `reset_prefix_cache` does, so it
leaves what it leaves after a completed abort.
"""

from __future__ import annotations

from itertools import count

import pytest
from test_llm_abort import LONG, MIB
from test_llm_abort_interrupts import aborted_with_an_interrupt

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import FinishReason
from kvtier.offload.config import OffloadConfig
from kvtier.transfer.worker import WorkerState

ENGINE = EngineConfig(num_gpu_blocks=12, block_size=4)
PROMPT = list(range(60, 92))  # 8 blocks, computed by the first step, stored by none yet
Outcome = tuple[RequestStatus, FinishReason | None, bool, int, int]


def running(offload: bool) -> tuple[LLM, Request]:
    """An engine with one request that ran one step (its prompt's blocks computed)."""
    config = OffloadConfig(cpu_bytes=4 * MIB) if offload else None
    llm = LLM(None, kv_offload=config, engine=ENGINE)
    request = llm.add_request(PROMPT, LONG)
    llm.step()
    assert request.status is RequestStatus.RUNNING
    return llm, request


def shut_down(llm: LLM, victim: Request) -> Outcome:
    """Shut down; return the victim's status and reason, whether any request is left,
    the GPU blocks free and the bytes stored to the tier."""
    llm.shutdown()
    if llm.offload is not None:
        assert llm.offload.worker.state is WorkerState.SHUT_DOWN
    num_bytes_stored = 0 if llm.offload is None else llm.offload.totals.num_bytes_stored
    return (
        victim.status,
        victim.finish_reason,
        llm.scheduler.has_unfinished(),
        llm.pool.num_free(),
        num_bytes_stored,
    )


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "no_offload"])
def test_a_shutdown_right_after_an_abort_cut_short_at_any_line(offload: bool) -> None:
    llm, victim = running(offload)
    llm.abort_request(victim)
    expected = shut_down(llm, victim)
    assert expected[:4] == (RequestStatus.FINISHED, FinishReason.ABORT, False, 11)
    assert (expected[4] > 0) is offload  # the abort queued the computed blocks' stores
    num_ended = 0  # aborts cut short that the shutdown ended
    for n in count(1):
        llm, victim = running(offload)
        landed = aborted_with_an_interrupt(llm, victim, n, retry=False)
        began = victim.status is RequestStatus.FINISHED
        began |= victim.request_id in llm.scheduler._aborting
        if not landed or not began:  # past the last line, or before the abort began
            llm.shutdown()
            if landed:
                continue
            assert num_ended > 4, f"only {num_ended} aborts cut short after they began"
            return
        num_ended += victim.request_id in llm.scheduler._aborting
        assert shut_down(llm, victim) == expected, f"interrupted at line {n}"
