"""`kvtier demo`'s verdict: tokens that differ between configurations are reported as a
bug and end the demo with status 1; runs whose tiers served nothing are named.

Found by a mutation run (s29): the demo's tests only ever saw identical tokens, so a
verdict that always said "yes" (or returned 0 whatever it said) passed them all.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_demo_cli_errors import run_demo, save_tiny_checkpoint

from kvtier.cli import demo
from kvtier.cli.demo import _untested_runs_note
from kvtier.engine.chat_workload import RunResult, TurnResult

CONFIGS = ["offload off", "CPU tier", "disk tier", "CPU+disk"]


def with_other_tokens(result: RunResult) -> RunResult:
    """Return `result` with its last turn's first output token changed."""
    *turns, last = result.turns
    first, *rest = last.output_token_ids
    changed = replace(last, output_token_ids=(first + 1, *rest))
    return replace(result, turns=(*turns, changed))


@pytest.mark.parametrize("wrong", CONFIGS)
def test_tokens_that_differ_in_one_configuration_are_reported_as_a_bug(
    wrong: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = []
    real_run_chat = demo.run_chat

    def run_chat(*args: object, **kwargs: object) -> RunResult:
        result = real_run_chat(*args, **kwargs)  # type: ignore[arg-type]
        served.append(result.name)
        return with_other_tokens(result) if result.name == wrong else result

    monkeypatch.setattr(demo, "run_chat", run_chat)
    model_dir = save_tiny_checkpoint(tmp_path / "ckpt")  # serves in about a second
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 1
    assert served == ["warm-up", *CONFIGS]
    out = capsys.readouterr().out
    assert out.endswith("identical tokens across configurations: NO — a bug\n")
    assert (tmp_path / "out" / "demo_ttft.png").is_file()  # the plot is still drawn


def test_runs_whose_tiers_served_nothing_are_named_before_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (s29 mutation run): with every history kept on the GPU (here one turn)
    no tier serves a token, each run computes its tokens as offload off does, and "identical
    tokens: yes" tested no tier, without a word about it."""
    model_dir = save_tiny_checkpoint(tmp_path / "ckpt")
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 0
    words = " ".join(capsys.readouterr().out.split())  # the console wraps the note
    assert words.endswith(
        "the CPU tier, disk tier and CPU+disk runs served no tokens from their tiers: their"
        " tokens were computed as with offload off, so comparing them tests no tier; use more"
        " --conversations or fewer --gpu-blocks, so that histories leave the GPU"
        " identical tokens across configurations: yes"
    )


def test_the_demo_says_where_it_plotted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before the verdict, the results name the plot's path. Found by a mutation run
    (s32): the demo could write its plot without a word of where, with every test passing."""
    model_dir = save_tiny_checkpoint(tmp_path / "ckpt")
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 0
    # Without whitespace: the console wraps (or folds) a line past its width, which a long
    # temp path under pytest-xdist reaches.
    text = "".join(capsys.readouterr().out.split())
    plotted = "".join(f"TTFT per turn plotted to {tmp_path / 'out' / 'demo_ttft.png'}".split())
    assert plotted in text
    assert text.index(plotted) < text.index("identicaltokensacrossconfigurations:yes")


def test_one_run_whose_tier_served_nothing_is_named_alone() -> None:
    def run(name: str, tier_hits: int) -> RunResult:
        return RunResult(name, (TurnResult(0, 1, 64, 0.1, (1,), 0, tier_hits),), 1.0, 0, 0)

    results = [run("offload off", 0), run("CPU tier", 16), run("disk tier", 0)]
    assert _untested_runs_note(results) == (
        "the disk tier run served no tokens from its tier: its tokens were computed as with"
        " offload off, so comparing them tests no tier; use more --conversations or fewer"
        " --gpu-blocks, so that histories leave the GPU"
    )
    assert _untested_runs_note([run("offload off", 0), run("CPU tier", 16)]) is None


def test_two_runs_whose_tiers_served_nothing_are_named_in_the_plural() -> None:
    """Two such runs are joined with "and" and take the plural ("runs", "their tiers"):
    the tests named one run or three, so a plural that began at three runs passed."""

    def run(name: str, tier_hits: int) -> RunResult:
        return RunResult(name, (TurnResult(0, 1, 64, 0.1, (1,), 0, tier_hits),), 1.0, 0, 0)

    results = [run("offload off", 0), run("CPU tier", 0), run("disk tier", 16), run("CPU+disk", 0)]
    assert _untested_runs_note(results) == (
        "the CPU tier and CPU+disk runs served no tokens from their tiers: their tokens were"
        " computed as with offload off, so comparing them tests no tier; use more"
        " --conversations or fewer --gpu-blocks, so that histories leave the GPU"
    )
