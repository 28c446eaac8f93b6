"""`benchmarks/bench_engine.py` measures steady state: each configuration serves an
uncounted warm-up pass of the workload's turns first, the measured reps alternate the
configurations' order, and torch runs `--threads` intra-op threads.

Regression: its first measured runs were much slower than later ones (offload off: 147 s,
then 16 s) and the median of its 2 reps counted them; 'off' always ran first in a rep.
Its only warm-up served 2-turn prompts of 128 tokens, far from the workload's longest.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier.engine.chat_workload import ChatWorkload, RunResult
from kvtier.engine.config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def test_run_order_gives_each_configuration_each_place_as_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_order = script("bench_engine", monkeypatch).run_order
    assert run_order(["off", "cpu"], 3) == [
        (0, "off"),
        (0, "cpu"),
        (1, "cpu"),
        (1, "off"),
        (2, "off"),
        (2, "cpu"),
    ]
    order = run_order(["off", "cpu", "disk"], 4)
    for rep in range(4):
        assert sorted(n for r, n in order if r == rep) == ["cpu", "disk", "off"]
    for name in ("off", "cpu", "disk"):
        places = [[n for r, n in order if r == rep].index(name) for rep in range(4)]
        assert places.count(0) == places.count(2)  # as often first as last


def serve_tiny(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[list[tuple[str, ChatWorkload, RunResult]], dict[str, Any], list[int]]:
    """Run bench_engine.main on the tiny model; return every run_chat call (name,
    workload, result), the JSON it wrote and the thread counts it set."""
    bench_engine = script("bench_engine", monkeypatch)
    monkeypatch.setattr(bench_engine.ModelConfig, "demo", staticmethod(ModelConfig.tiny))
    calls: list[tuple[str, ChatWorkload, RunResult]] = []
    real_run_chat = bench_engine.run_chat

    def recording_run_chat(llm: Any, workload: ChatWorkload, name: str, **kw: Any) -> RunResult:
        result = real_run_chat(llm, workload, name, **kw)
        calls.append((name, workload, result))
        return result

    threads: list[int] = []
    monkeypatch.setattr(bench_engine, "run_chat", recording_run_chat)
    monkeypatch.setattr(bench_engine.torch, "set_num_threads", threads.append)
    out = tmp_path / "engine.json"
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", *argv, "--json", str(out)])
    bench_engine.main()
    return calls, json.loads(out.read_text()), threads


def test_the_warm_up_serves_the_workloads_turns_and_is_not_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--reps", "2", "--conversations", "3", "--turns", "3"]
    calls, record, _ = serve_tiny([*argv, "--warmup-conversations", "1"], monkeypatch, tmp_path)
    assert [name for name, _, _ in calls] == [
        "warm-up: off",
        "warm-up: cpu",
        "rep 0: off",
        "rep 0: cpu",
        "rep 1: cpu",
        "rep 1: off",
    ]
    for _, workload, _ in calls[:2]:  # the longest prompts of the measured workload
        assert (workload.num_conversations, workload.num_turns) == (1, 3)
    for _, workload, _ in calls[2:]:
        assert (workload.num_conversations, workload.num_turns) == (3, 3)
    measured = {"off": [calls[2][2], calls[5][2]], "cpu": [calls[3][2], calls[4][2]]}
    for name, results in measured.items():  # the warm-up's numbers are in no median
        assert record["runs"][name]["tokens_per_s"] == [r.tokens_per_s for r in results]
    out = capsys.readouterr().out
    assert "(not counted)" in out.split("warm-up: off  wall")[1].splitlines()[0]
    assert "warm-up: 1 conversations per configuration, not counted" in out


def test_no_warm_up_with_zero_warmup_conversations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = ["--reps", "1", "--conversations", "2", "--turns", "2", "--warmup-conversations", "0"]
    calls, record, _ = serve_tiny(argv, monkeypatch, tmp_path)
    assert [name for name, _, _ in calls] == ["rep 0: off", "rep 0: cpu"]
    assert len(record["runs"]["off"]["tokens_per_s"]) == 1


@pytest.mark.parametrize(("value", "expected"), [("1", [1]), ("2", [2]), ("0", [])])
def test_threads_sets_torchs_intra_op_threads(
    value: str, expected: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = ["--reps", "1", "--conversations", "1", "--turns", "1", "--threads", value]
    _, _, threads = serve_tiny([*argv, "--warmup-conversations", "0"], monkeypatch, tmp_path)
    assert threads == expected
