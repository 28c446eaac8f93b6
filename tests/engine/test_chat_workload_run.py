"""`run_chat` serves the workload its docstring describes, and reports what was served.

Found by a mutation run (s32), each with every test passing: conversations given a
system prompt each (no shared prefix), answers left out of the next turn's history,
EOS honoured (answers cut short), one answer token too many, the seed ignored, turns
served in another order, a turn's conversation and turn number swapped, its local and
external hits swapped, its prompt length misread, the offload totals read before the
finish-time stores drained, loaded and stored bytes swapped, copy seconds reported as
bytes and the tier hits dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtier.engine.chat_workload import ChatWorkload, RunResult, TurnResult, run_chat
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import OffloadConfig

MIB = 1 << 20
# Every token is an EOS: only ignore_eos lets an answer run to its length.
ALL_EOS = dataclasses.replace(
    ModelConfig.tiny(), eos_token_ids=tuple(range(ModelConfig.tiny().vocab_size))
)
WORKLOAD = ChatWorkload(3, 3, 8, 8, 4, 2, vocab_size=ALL_EOS.vocab_size)


def _serve(
    workload: ChatWorkload, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> tuple[RunResult, list[list[int]]]:
    """Run the workload on `llm`, recording each prompt handed to `generate`."""
    prompts: list[list[int]] = []
    generate = llm.generate

    def recording(batch: list[list[int]], params: Any) -> Any:
        prompts.extend(list(p) for p in batch)
        return generate(batch, params)

    monkeypatch.setattr(llm, "generate", recording)
    return run_chat(llm, workload, "run"), prompts


def test_each_turn_extends_its_conversations_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversations share the system prompt, each has its own document, and a turn's
    prompt is the last prompt, its answer and new user tokens; turns go round-robin."""
    with LLM(ALL_EOS, engine=EngineConfig(block_size=4, num_gpu_blocks=64)) as llm:
        result, prompts = _serve(WORKLOAD, llm, monkeypatch)
    served = [(t.conversation, t.turn) for t in result.turns]
    assert served == [(c, t) for t in range(3) for c in range(3)]
    assert [t.num_prompt_tokens for t in result.turns] == [len(p) for p in prompts]
    assert all(len(t.output_token_ids) == 2 for t in result.turns)
    first = prompts[:3]
    assert [p[:8] for p in first] == [first[0][:8]] * 3
    assert len({tuple(p[8:16]) for p in first}) == 3
    assert all(len(p) == 8 + 8 + 4 for p in first)
    for i, turn in enumerate(result.turns[3:], start=3):
        previous = prompts[i - 3]
        answer = result.turns[i - 3].output_token_ids
        assert prompts[i][: len(previous) + 2] == previous + list(answer)
        assert len(prompts[i]) == len(previous) + 2 + 4
        # The GPU pool holds every history: later turns hit locally, nothing external.
        assert turn.num_local_hit_tokens > 0
        assert turn.num_external_hit_tokens == 0


def test_the_seed_draws_the_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    def first_prompt(seed: int) -> list[int]:
        workload = dataclasses.replace(WORKLOAD, num_conversations=1, num_turns=1, seed=seed)
        with LLM(ModelConfig.tiny(), engine=EngineConfig(num_gpu_blocks=16)) as llm:
            return _serve(workload, llm, monkeypatch)[1][0]

    assert first_prompt(1) == first_prompt(1)
    assert first_prompt(1) != first_prompt(0)


def test_the_offload_totals_are_reported_after_the_stores_drained() -> None:
    """A GPU pool too small for all histories: they go to the CPU tier and come back.
    The last answer's finish-time store is issued by `drain` (the answer ends a block),
    so totals read before it miss that store."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=12)
    workload = ChatWorkload(4, 3, 8, 8, 4, 3, vocab_size=128)
    with LLM(ModelConfig.tiny(), kv_offload=OffloadConfig(cpu_bytes=4 * MIB), engine=engine) as llm:
        result = run_chat(llm, workload, "cpu")
        llm.drain()  # nothing left to drain: the totals stay as reported
        totals = llm.offload.totals if llm.offload is not None else None
        assert totals is not None
        assert totals.num_issued_events == totals.num_reported_events
        assert (result.num_bytes_loaded, result.num_bytes_stored) == (
            totals.num_bytes_loaded,
            totals.num_bytes_stored,
        )
        assert result.hit_tokens_by_tier == totals.hit_tokens
        assert result.transfer_bytes == totals.transfer_bytes
        assert result.transfer_seconds == totals.transfer_seconds
    # Loads and stores each go their own way (the tiny workload moves different amounts).
    assert result.num_bytes_loaded == result.transfer_bytes["CPU_to_GPU"] > 0
    assert result.num_bytes_stored == result.transfer_bytes["GPU_to_CPU"] > 0
    assert result.num_bytes_loaded != result.num_bytes_stored
    assert result.hit_tokens_by_tier.get("CPU", 0) > 0
    assert all(type(s) is float for s in result.transfer_seconds.values())
    assert any(t.num_external_hit_tokens > 0 for t in result.turns)


def test_output_tokens_are_in_conversation_then_turn_order() -> None:
    turns = tuple(TurnResult(c, t, 8, 0.1, (10 * c + t,), 0, 0) for t in range(2) for c in range(3))
    result = RunResult("run", turns, 1.0, 0, 0)
    assert result.output_tokens == [(0,), (1,), (10,), (11,), (20,), (21,)]
