"""A Ctrl-C while `BlockGrowth._grow` appends a scheduled request's new blocks.

Regression: `_grow` took the blocks from the pool in one statement and put them into the
request's table in the next; a Ctrl-C in between left them in no table, so neither the
abort of the interrupted call nor the drained engine ever freed them (the pool leaked).
"""

from __future__ import annotations

import sys
from typing import Any

from test_llm_poll_interrupts import LineInterrupt

from kvtier.engine.block_growth import BlockGrowth
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=16)
NUM_LINES = 10  # the first call's lines, for one group: past its last one


def serve(llm: LLM, prompt_list: list[list[int]]) -> list[tuple[int, ...]]:
    """Run `prompt_list` by `generate` until a call is not interrupted; return its tokens."""
    for _ in range(3):
        try:
            return [o.output_token_ids for o in llm.generate(prompt_list, PARAMS)]
        except KeyboardInterrupt:
            continue
    raise AssertionError("every call was interrupted")


def test_an_interrupt_at_any_line_of_a_growth_leaks_no_block() -> None:
    prompt_list = [[(5 * i + j) % 100 for j in range(14)] for i in range(2)]
    with LLM(None, engine=ENGINE) as reference:
        expected = serve(reference, prompt_list)
    for n in range(1, NUM_LINES + 1):
        llm = LLM(None, engine=ENGINE)
        tracer = LineInterrupt(n, (BlockGrowth._grow.__code__,))
        grow = llm.scheduler._grow

        def growing(request: Any, num_new: int, grow: Any = grow, tracer: Any = tracer) -> Any:
            tracer.counting = True
            return grow(request, num_new)

        llm.scheduler._grow = growing  # type: ignore[method-assign]
        sys.settrace(tracer)
        try:
            served = serve(llm, prompt_list)
        finally:
            sys.settrace(None)
        assert tracer.landed == [True], f"line {n} never ran"
        assert served == expected, f"interrupted at line {n}"
        llm.pool.check_invariants()
        assert llm.pool.num_free() == llm.pool.num_usable_blocks, f"interrupted at line {n}"
        llm.shutdown()
