"""Sliding-window blocks a request no longer attends to go back to the pool in the step
that leaves them behind (`Scheduler.complete`)."""

from __future__ import annotations

import dataclasses

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams


def test_out_of_window_blocks_are_free_when_the_step_returns() -> None:
    """Sliding-window layers only (window 8, blocks of 4), 8 usable blocks: a 13-token
    prompt decodes 8 tokens. After every step each block is free or in its table (none
    taken out of it and left unfreed until the next step), and its window dropped blocks
    as it went (the null block stands for them).
    Mutation: `_drop_out_of_window` never freed what it took (the blocks waited for the
    next step's `_settle`: the pool short of them between steps)."""
    model = dataclasses.replace(
        ModelConfig.tiny(),
        layer_kinds=(AttentionKind.SLIDING, AttentionKind.SLIDING),
        sliding_window=8,
    )
    llm = LLM(model, engine=EngineConfig(block_size=4, num_gpu_blocks=9))
    request = llm.add_request(list(range(13)), SamplingParams(max_tokens=8, ignore_eos=True))
    nulls = []
    while llm.scheduler.has_unfinished():
        llm.step()
        held = [b for table in request.block_tables for b in table if b != NULL_BLOCK_ID]
        assert llm.pool.num_free() == llm.pool.num_usable_blocks - len(held)
        nulls.append(sum(table.count(NULL_BLOCK_ID) for table in request.block_tables))
    assert nulls == [1, 1, 2, 2, 2, 2, 3, 0]
