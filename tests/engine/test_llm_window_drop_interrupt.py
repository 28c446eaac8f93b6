"""A Ctrl-C while a step gives back a sliding-window request's out-of-window blocks.

Regression: `drop_out_of_window` freed a block before taking it out of the request's
table; a Ctrl-C in between made the step abort its requests, and the abort freed the
block again (PoolError, the engine's pool left inconsistent). Now the block leaves the
table first.

Regression too: cut short once the block had left the table but before the pool freed
it, the block leaked (the drained pool one block short). Now it leaves the table onto
the scheduler's `_unfreed` in one statement, and `_settle` (or the abort) frees it.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from test_llm_poll_interrupts import LineInterrupt, interrupt_once

from kvtier.engine import block_cache
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.queue_recovery import QueueRecovery
from kvtier.engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
ENGINE = EngineConfig(num_gpu_blocks=32, max_num_batched_tokens=16)
NUM_LINES = 8  # the first drop's loop, its free, and the frees after it


def serve(llm: LLM, prompt_list: list[list[int]]) -> None:
    """Run `prompt_list` by `generate` until a call is not interrupted."""
    for _ in range(3):
        try:
            llm.generate(prompt_list, PARAMS)
            return
        except KeyboardInterrupt:
            continue


def test_an_interrupt_after_an_out_of_window_block_was_freed() -> None:
    prompt_list = [[(5 * i + j) % 100 for j in range(40)] for i in range(2)]
    with LLM(ModelConfig.tiny_hybrid(), engine=ENGINE) as reference:
        expected = [o.output_token_ids for o in reference.generate(prompt_list, PARAMS)]
    llm = LLM(ModelConfig.tiny_hybrid(), engine=ENGINE)
    pool = llm.pool
    free = pool.free
    drop = llm.scheduler._drop_out_of_window
    interrupted: list[bool] = []
    dropping: list[bool] = []

    def freeing(block_ids: Any) -> None:
        free(block_ids)
        if dropping:
            interrupt_once(interrupted, "Ctrl-C after an out-of-window block was freed")

    def dropping_out(*args: Any) -> None:
        dropping.append(True)
        try:
            drop(*args)
        finally:
            dropping.clear()

    pool.free = freeing  # type: ignore[method-assign]
    llm.scheduler._drop_out_of_window = dropping_out  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_list, PARAMS)
    assert interrupted == [True]
    pool.check_invariants()
    assert [o.output_token_ids for o in llm.generate(prompt_list, PARAMS)] == expected
    pool.check_invariants()
    assert pool.num_free() == pool.num_usable_blocks
    llm.shutdown()


def test_an_interrupt_at_any_line_of_the_first_window_drop() -> None:
    """A Ctrl-C at the 1st, 2nd, ... line run from the first call dropping a block out
    of the window (`drop_out_of_window` and the frees after it), for its first lines:
    the block is freed once, none leaks (regression: one between leaving the table and
    being freed leaked)."""
    prompt_list = [[(5 * i + j) % 100 for j in range(40)] for i in range(2)]
    codes = (block_cache.drop_out_of_window.__code__, QueueRecovery._free_unfreed.__code__)
    for n in range(1, NUM_LINES + 1):
        llm = LLM(ModelConfig.tiny_hybrid(), engine=ENGINE)
        tracer = LineInterrupt(n, codes)
        pool = llm.pool
        drop = llm.scheduler._drop_out_of_window

        def dropping_out(request: Any, drop: Any = drop, tracer: Any = tracer) -> None:
            tracer.counting = True
            drop(request)

        llm.scheduler._drop_out_of_window = dropping_out  # type: ignore[method-assign]
        sys.settrace(tracer)
        try:
            serve(llm, prompt_list)
        finally:
            sys.settrace(None)
        assert tracer.landed == [True], f"line {n} never ran"
        serve(llm, prompt_list)
        pool.check_invariants()
        assert pool.num_free() == pool.num_usable_blocks, f"interrupted at line {n}"
        llm.shutdown()
