"""A count of one is singular in the engine's errors: "1 usable block", "1 token", not
"1 usable blocks" / "1 tokens" (the demo shows them; found grepping the messages built
from counts after "(1 usable blocks)" in the demo)."""

from __future__ import annotations

import pytest
from step_watchdog import with_watchdog

from kvtier.engine import runner as runner_module
from kvtier.engine import validation
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.runner import KVCacheTooLargeError
from kvtier.engine.sampling import SamplingParams

ONE_USABLE = EngineConfig(block_size=1, num_gpu_blocks=2)  # block 0 is the null block


def test_a_kv_cache_of_one_token_blocks_is_told_in_the_singular(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner_module, "total_memory_bytes", lambda: 1)
    with pytest.raises(KVCacheTooLargeError, match=r"\(2 blocks x 1 token x 512 bytes\)"):
        LLM(ModelConfig.tiny(), engine=ONE_USABLE)


def test_a_one_token_prompt_beyond_one_usable_block_is_told_in_the_singular() -> None:
    llm = LLM(ModelConfig.tiny(), engine=ONE_USABLE)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with pytest.raises(
        ValueError,
        match=r": prompt of 1 token \+ max_tokens=3 needs at least 3 KV blocks at one step, "
        r"more than the GPU pool's 1 usable block \(raise",
    ):
        llm.generate([[5]], params)
    llm.shutdown()


def test_a_stall_on_one_block_of_one_token_is_told_in_the_singular(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The up-front check bypassed, as in test_llm_lifecycle's stall test."""
    llm = LLM(ModelConfig.tiny(), engine=ONE_USABLE)
    with_watchdog(llm, 500)()  # a hang fails the test instead of blocking pytest
    monkeypatch.setattr(validation, "num_peak_blocks", lambda layout, num_tokens: 0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with pytest.raises(
        RuntimeError,
        match=r"^no progress possible: req-0 \(2 tokens\) does not fit the GPU pool of 1 block "
        r"of 1 token; it was aborted$",
    ):
        llm.generate([[5, 6]], params)
    llm.shutdown()
