"""A Ctrl-C while a step gives back a sliding-window request's out-of-window blocks.

Regression: `drop_out_of_window` freed a block before taking it out of the request's
table; a Ctrl-C in between made the step abort its requests, and the abort freed the
block again (PoolError, the engine's pool left inconsistent). Now the block leaves the
table first.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_llm_poll_interrupts import interrupt_once

import kvtier.engine.scheduler as scheduler_module
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
ENGINE = EngineConfig(num_gpu_blocks=32, max_num_batched_tokens=16)


def test_an_interrupt_after_an_out_of_window_block_was_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt_list = [[(5 * i + j) % 100 for j in range(40)] for i in range(2)]
    with LLM(ModelConfig.tiny_hybrid(), engine=ENGINE) as reference:
        expected = [o.output_token_ids for o in reference.generate(prompt_list, PARAMS)]
    llm = LLM(ModelConfig.tiny_hybrid(), engine=ENGINE)
    pool = llm.pool
    free = pool.free
    drop = scheduler_module.drop_out_of_window
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
    monkeypatch.setattr(scheduler_module, "drop_out_of_window", dropping_out)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_list, PARAMS)
    assert interrupted == [True]
    pool.check_invariants()
    assert [o.output_token_ids for o in llm.generate(prompt_list, PARAMS)] == expected
    pool.check_invariants()
    assert pool.num_free() == pool.num_usable_blocks
    llm.shutdown()
