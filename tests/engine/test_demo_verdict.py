"""`kvtier demo`'s verdict: tokens that differ between configurations are reported as a
bug and end the demo with status 1.

Found by a mutation run (s29): the demo's tests only ever saw identical tokens, so a
verdict that always said "yes" (or returned 0 whatever it said) passed them all.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_demo_cli_errors import run_demo, save_tiny_checkpoint

from kvtier.cli import demo
from kvtier.engine.chat_workload import RunResult

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
