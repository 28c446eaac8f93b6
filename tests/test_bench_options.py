"""The benchmark scripts' options: bad values end them at once with argparse's one-line
error naming the option, and every option's --help states its default.

Regressions: `bench_manifest.py --records -5` and `bench_cascade.py --requests 0` were
accepted; a missing `--trace` or `--dir` was a traceback, an unwritable `--json` one
after the whole run; `bench_vllm_connector.py --help` failed without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py") if p.stem != "bench_common")


def script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def test_every_script_is_covered() -> None:
    assert len(SCRIPTS) == 10
    assert {name for name, _, _ in BAD_VALUES} == set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_states_each_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = script(name, monkeypatch).build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action) or ""
        assert action.help, f"{name} {action.option_strings} has no help"
        if action.default is not None and action.default is not False:
            assert "default" in text, f"{name} {action.option_strings}: {text!r}"
    parser.format_help()  # every help string formats


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_the_whole_docstring(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: --help showed only the docstring's first line, not what the benchmark
    measures or how to read it; the paragraphs and lists keep their lines."""
    module = script(name, monkeypatch)
    assert module.__doc__.strip() in module.build_parser().format_help()


BAD_VALUES = [
    ("bench_cascade", ["--trace", "/nonexistent/t.jsonl"], "--trace: /nonexistent/t.jsonl does"),
    ("bench_cascade", ["--requests", "0"], "--requests: expected a number >= 1, got 0"),
    ("bench_disk", ["--dir", "/nonexistent"], "--dir: /nonexistent does not exist"),
    ("bench_disk", ["--copy-threads", "0"], "--copy-threads: expected a number >= 1, got 0"),
    ("bench_engine", ["--turns", "x"], "--turns: expected a whole number, got 'x'"),
    ("bench_manifest", ["--records", "-5"], "--records: expected a number >= 1, got -5"),
    ("bench_manifest", ["--json", "/nonexistent/r.json"], "--json: /nonexistent does not"),
    ("bench_policies", ["--policy", "lru+nope"], "--policy: unknown admission policy 'nope'"),
    ("bench_policies", ["--reuse", "2"], "--reuse: expected a number in [0, 1], got 2"),
    ("bench_pool", ["--sizes", "1000,0"], "--sizes: expected a number >= 1, got 0"),
    ("bench_replay", ["--out", "/proc/out"], "--out: /proc: cannot create files in /proc"),
    ("bench_replay", ["--jobs", "0"], "--jobs: expected a number >= 1, got 0"),
    ("bench_scheduler", ["--output-tokens", "9,2"], "--output-tokens: expected MIN,MAX"),
    ("bench_transfer", ["--regions", "1", "-3"], "--regions: expected a number >= 1, got -3"),
    ("bench_vllm_connector", ["--modes", "lazy,lazy"], "--modes: expected a comma list"),
    ("bench_vllm_connector", ["--window", "0"], "--window: expected a number >= 1, got 0"),
    ("bench_vllm_connector", ["--copies", "sync"], "--copies: invalid choice: 'sync'"),
    ("bench_vllm_connector", ["--policy", "lru+nope"], "--policy: unknown admission policy"),
]


@pytest.mark.parametrize(("name", "argv", "message"), BAD_VALUES)
def test_a_bad_value_is_named_before_anything_runs(
    name: str,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = script(name, monkeypatch).build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    assert f"error: argument {message}" in capsys.readouterr().err


def test_an_output_file_is_tried_when_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = script("bench_common", monkeypatch)
    assert common.output_file(str(tmp_path / "r.json")) == tmp_path / "r.json"
    assert common.output_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    for bad in (str(tmp_path), ""):
        with pytest.raises(argparse.ArgumentTypeError):
            common.output_file(bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        common.output_dir(str(tmp_path / "file"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no probe left behind


def test_the_vllm_benchmark_without_vllm_says_where_to_run_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = script("bench_vllm_connector", monkeypatch)
    if module.VLLM_MISSING is None:
        pytest.skip("vLLM is installed here")
    monkeypatch.setattr(sys, "argv", ["bench_vllm_connector.py", "--quick"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    assert "make bench-vllm" in capsys.readouterr().err


def test_bench_scheduler_s_vllm_mode_is_the_vllm_connector_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #8's mode: `bench_scheduler.py --vllm ARGS` runs `bench_vllm_connector.py ARGS`
    (its options, its errors); `--vllm` after another option is refused."""
    bench_scheduler = script("bench_scheduler", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--vllm", "--window", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench_scheduler.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bench_scheduler.py --vllm: error: argument --window: expected a number >= 1" in err
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--quick", "--vllm"])
    with pytest.raises(SystemExit):
        bench_scheduler.main()
    assert "--vllm must come first" in capsys.readouterr().err


def test_bench_transfer_needs_a_block_size_its_summary_covers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: with every --block-kib below 64 the run ended, after all its work, in
    `min() arg is an empty sequence` where the summary's sizes were selected."""
    bench_transfer = script("bench_transfer", monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench_transfer.parse_args(["--block-kib", "4", "16"])
    assert exit_info.value.code == 2
    assert (
        "--block-kib: the summary and its target are over blocks of >= 64 KiB; got only 4 16"
        in (capsys.readouterr().err)
    )
    assert bench_transfer.parse_args(["--block-kib", "4", "64"]).block_kib == [4, 64]


def test_bench_transfer_and_bench_disk_name_themselves_in_the_summary_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: their summary lines began `summary:`, where every other benchmark's
    begins with its name (what scripts/gpu_check.sh and a reader of mixed logs grep)."""
    transfer = script("bench_transfer", monkeypatch)
    ratios = dict.fromkeys(transfer.PATTERNS, 0.8)
    spreads = dict.fromkeys(transfer.PATTERNS, (0.7, 0.9))
    row = transfer.Row(64, 1, 16, 1.0, 10.0, ratios, ratios, spreads)
    transfer.summarize([row], "cpu", 1.0)
    assert capsys.readouterr().out.startswith("bench_transfer: store/load at >= 64 KiB ")
    disk = script("bench_disk", monkeypatch)
    rows = [
        disk.Row(mode, 64, 1, 16, 5.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.9, (0.8, 1.0), (0.8, 1.0))
        for mode in ("direct", "page_cache")
    ]
    disk.summarize(rows, 1.0)
    assert capsys.readouterr().out.startswith("bench_disk: direct I/O store 0.90x / load ")


class _StoppedError(Exception):
    """What a stubbed call raises, to stop the script there."""


@pytest.mark.parametrize(
    ("policy", "argv", "restarted"),
    [
        (None, [], True),
        ("ACTIVE", [], True),
        ("PASSIVE", [], False),
        (None, ["--omp-wait-policy", "inherit"], False),
    ],
)
def test_bench_transfer_runs_with_a_passive_openmp_wait_policy(
    policy: str | None, argv: list[str], restarted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spinning OpenMP threads left by the baseline copy took the cores from the transfer
    timed next (0.46x against 0.71x): the script starts itself again with the policy set
    to PASSIVE, unless told to inherit the environment's."""
    bench_transfer = script("bench_transfer", monkeypatch)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setattr(sys, "argv", ["bench_transfer.py", *argv])
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        calls.append((path, args, env))
        raise _StoppedError

    def run_config(*_: object) -> None:
        raise _StoppedError

    monkeypatch.setattr(bench_transfer.os, "execve", execve)
    monkeypatch.setattr(bench_transfer, "run_config", run_config)
    with pytest.raises(_StoppedError):
        bench_transfer.main()
    if restarted:
        assert [(path, args, env["OMP_WAIT_POLICY"]) for path, args, env in calls] == [
            (sys.executable, [sys.executable, "bench_transfer.py", *argv], "PASSIVE")
        ]
    else:
        assert calls == []


def test_bench_engine_reports_no_ratio_when_no_history_left_the_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a run too small to push any history off the GPU pool ended in a
    ZeroDivisionError after it was served."""
    bench_engine = script("bench_engine", monkeypatch)
    run = {"ttft_p50_s": [0.1], "ttft_p90_s": [0.2], "tokens_per_s": [100.0]}
    run |= {"ttft_history_off_gpu_p50_s": [0.0], "tier_hit_tokens": [0.0]}
    summary = bench_engine._report({"off": run, "cpu": dict(run, tokens_per_s=[120.0])})
    assert summary == {"cpu_ttft_off_gpu_ratio": None, "cpu_throughput_ratio": 1.2}
    assert "TTFT (history off GPU) n/a" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("gpu_blocks", "message"),
    [
        ("1", "argument --gpu-blocks: EngineConfig.num_gpu_blocks=1 leaves no block besides"),
        ("10", "more than --gpu-blocks=10 can hold (9 usable blocks): raise --gpu-blocks to"),
    ],
)
def test_bench_engine_refuses_a_gpu_pool_too_small_for_its_workload(
    gpu_blocks: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Regression: `--gpu-blocks 1` and `--gpu-blocks 10` passed the option's type and
    ended in a ValueError traceback naming EngineConfig, or a prompt of the warm-up,
    not the option; now a usage error names it (and the least pool that fits)."""
    bench_engine = script("bench_engine", monkeypatch)
    argv = ["--gpu-blocks", gpu_blocks, "--reps", "1", "--conversations", "1", "--turns", "1"]
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_engine.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
