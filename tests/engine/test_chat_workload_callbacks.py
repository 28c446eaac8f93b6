"""`run_chat`'s callbacks: `on_request` after each answer, `on_turn` after each round of
turns, and neither's time counted in the run's wall time (a benchmark's progress bar
moves in them: `benchmarks/bench_engine.py`).

Regression: `run_chat` had only `on_turn`, so a bar could move once per round of turns
(in one default bench_engine run, 39 s of 55 s passed before the first round ended),
and the time `on_turn` took was part of `wall_s`.
"""

from __future__ import annotations

import time

from kvtier.engine.chat_workload import ChatWorkload, run_chat
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig

PAUSE_S = 0.05


def test_callbacks_follow_each_answer_and_round_and_stay_out_of_the_wall_time() -> None:
    model = ModelConfig.tiny()
    workload = ChatWorkload(3, 2, 8, 8, 4, 2, vocab_size=model.vocab_size)
    calls: list[str] = []

    def on_request() -> None:
        calls.append("request")
        time.sleep(PAUSE_S)

    def on_turn() -> None:
        calls.append("turn")
        time.sleep(PAUSE_S)

    with LLM(model, engine=EngineConfig(num_gpu_blocks=64)) as llm:
        start = time.perf_counter()
        result = run_chat(llm, workload, "run", on_turn=on_turn, on_request=on_request)
        elapsed = time.perf_counter() - start
    assert calls == ["request"] * 3 + ["turn"] + ["request"] * 3 + ["turn"]
    assert len(result.turns) == 6
    paused = len(calls) * PAUSE_S
    assert 0 < result.wall_s <= elapsed - paused
