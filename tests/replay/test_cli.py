"""`kvtier replay` as a command: options, table, JSON, sweep files, errors."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.cli import add_parser, configure, main, parse_tokens
from kvtier.replay.trace import write_trace


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("300k", 300_000), ("1M", 1_000_000), ("1.5m", 1_500_000), ("4096", 4096), ("2G", 2 * 10**9)],
)
def test_parse_tokens(text: str, tokens: int) -> None:
    assert parse_tokens(text) == tokens


def test_parse_tokens_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid token count '3X'"):
        parse_tokens("3X")


@pytest.mark.parametrize("text", ["10MiB", "10MB", "10 mb", "1.5GiB", "512B", "4 KiB"])
def test_a_capacity_in_bytes_is_told_it_counts_tokens(text: str) -> None:
    """`--capacity 10MiB` was told only to use digits and k, M or G: not that a capacity
    counts tokens, nor where the bytes per token are set."""
    with pytest.raises(
        argparse.ArgumentTypeError,
        match=rf"invalid token count {text!r}: a capacity counts tokens, not bytes.*"
        "--bytes-per-token",
    ):
        parse_tokens(text)


def test_a_near_whole_capacity_is_refused_with_its_exact_value() -> None:
    """Regression: the message printed the value as a float: '1000000000.0 is not a whole
    number of tokens', then as a fraction ('30864/25' for 1.23456k)."""
    with pytest.raises(
        argparse.ArgumentTypeError,
        match=r"not a whole number of tokens \(it is 1000000000\.0000000001\)",
    ):
        parse_tokens("1.0000000000000000001G")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(it is 1234\.56\)"):
        parse_tokens("1.23456k")


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "doc.jsonl"
    write_trace(path, doc_trace(seed=5, num_requests=60))
    return path


def test_json_has_every_policy_and_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--quiet"]
    argv += ["--policy", "ARC"]  # --json adds lru and belady
    argv += ["--capacity", "40", "--capacity", "0.2k", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["token_hit_ratio"]) == {"lru", "arc", "belady"}
    assert set(data["token_hit_ratio"]["lru"]) == {"40", "200"}
    assert len(data["points"]) == 6
    bound = data["token_hit_ratio"]["belady"]
    for row in data["points"]:
        assert row["token_hit_ratio"] <= bound[str(row["capacity_tokens"])] + 1e-6
    table = capsys.readouterr().out
    assert "xBelady" in table
    assert "arc" in table


def test_sweep_writes_csv_and_plot_with_lru_and_belady(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--quiet", "--sweep"]
    argv += ["--policy", "s3fifo", "--capacity", "24", "--capacity", "80", "--out", str(out)]
    argv += ["--gpu-capacity", "400", "--disk-capacity", "160"]
    assert main(argv) == 0
    rows = (out / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("policy,capacity_tokens,token_hit_ratio")
    assert {r.split(",")[0] for r in rows[1:]} == {"s3fifo", "lru", "belady"}
    assert "disk_token_hit_ratio" in rows[0]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_malformed_trace_is_an_error_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1]}\n{\n')
    assert main([str(path), "--block-size", "8", "--capacity", "64", "--quiet"]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_bad_policy_and_capacity_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.jsonl"), "--policy", "mru"])
    assert main([str(trace_file(tmp_path)), "--capacity", "100", "--quiet"]) == 2


def test_add_parser_mounts_the_command() -> None:
    parser = argparse.ArgumentParser(prog="kvtier")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", "t.jsonl", "--policy", "lfuda+door", "--capacity", "1M"])
    assert args.policy == ["lfuda+door"]
    assert args.capacity == [1_000_000]
    assert callable(args.run)


@pytest.mark.parametrize(
    "text",
    [
        "\u0661\u0660\u0660k",  # Arabic-Indic 100k
        "\uff13M",  # full-width 3M
        "1\u06f00000",  # an Extended Arabic-Indic zero among ASCII digits
        "\uff11.\uff15M",  # full-width 1.5M
        "2\u212a",  # 2 and the Kelvin sign, which case-folds to k
    ],
)
@pytest.mark.parametrize(
    ("option", "name"),
    [
        ("--capacity", "--capacity/--cpu"),
        ("--cpu", "--capacity/--cpu"),
        ("--gpu-capacity", "--gpu-capacity"),
        ("--disk", "--disk-capacity/--disk"),
    ],
)
def test_token_counts_take_ascii_digits_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, option: str, name: str
) -> None:
    """int() and Fraction read other scripts' digits, so Arabic-Indic 100k ran as 100k."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "t.jsonl"), option, text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {name}: invalid token count {text!r}: use digits 0-9" in err


def test_verbose_logs_each_point_as_it_is_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression: `kvtier replay -v` logged nothing, so the option changed no output.
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--quiet", "-v"]
    argv += ["--policy", "lru", "--policy", "arc", "--capacity", "40"]
    with caplog.at_level(logging.INFO, logger="kvtier.replay"):
        assert main(argv) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.replay.sweep"]
    assert len(lines) == 2
    assert lines[0].startswith("lru at 40 tokens: lower-tier token hit ratio ")
    assert lines[1].startswith("arc at 40 tokens: ")
    assert lines[1].endswith("(point 2 of 2)")


def test_the_help_says_what_the_independent_disk_tier_is_offered() -> None:
    """Without --cascade DISK is offered every block it lacks, also one the CPU holds:
    CPU 2 blocks, DISK 1; A, B, A: the CPU serves A at request 3 and DISK stores A again
    (3 stores), which "every block the CPU lacks is offered to both" denied."""
    from kvtier.replay.tier_replay import ReplayConfig, TierConfig, replay_trace
    from kvtier.replay.trace import TraceRecord

    records = [TraceRecord(i, BLOCK, 1, (h,)) for i, h in enumerate([1, 2, 1])]
    tiers = (TierConfig("CPU", 2 * BLOCK, 25.0), TierConfig("DISK", BLOCK, 5.0))
    cpu, disk = replay_trace(records, ReplayConfig(tiers=tiers, block_size=BLOCK)).tiers
    assert (cpu.num_hit_blocks, cpu.num_stored_blocks, disk.num_stored_blocks) == (1, 2, 3)
    parser = argparse.ArgumentParser(prog="kvtier replay")
    configure(parser)
    text = " ".join(parser.format_help().split())
    assert "every block the CPU lacks is offered to both" not in text
    assert "every block a tier lacks is offered to it, whether or not the CPU holds it" in text


def test_the_cost_model_options_name_their_units() -> None:
    # Regression: --prefill-tokens-per-s said "prefill speed (default 10000)", no unit.
    parser = argparse.ArgumentParser(prog="kvtier replay")
    configure(parser)
    helps = {action.dest: action.help or "" for action in parser._actions}
    assert "tokens/s" in helps["prefill_tokens_per_s"]
    assert "bytes per token" in helps["bytes_per_token"]
    assert "GB/s" in helps["cpu_link_gbps"]
    assert "GB/s" in helps["disk_link_gbps"]
