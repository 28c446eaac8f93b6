"""How `kvtier replay` plans its tiers from the capacity options: a capacity of exactly one
block is enough, a DISK tier gets the disk link by default, --sweep keeps the capacities
given (each found by a mutation run: no test pinned it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.cli import configure
from kvtier.replay.plan import build_config, plan_replay
from kvtier.replay.trace import write_trace


def parse_for(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


def parse(*argv: str) -> argparse.Namespace:
    return parse_for(["t.jsonl", *argv])


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-size", "8", "--capacity", "8", "--disk", "8", "--gpu-capacity", "8"],
        ["--sweep", "--block-size", "100000"],  # the smallest default sweep capacity, 100k
        ["--block-size", "1000000"],  # the default capacity, 1M
    ],
)
def test_a_capacity_of_one_block_is_accepted(argv: list[str]) -> None:
    """build_config raised ReplayError ("holds no ...-token block") on a mutant."""
    args = parse(*argv)
    assert build_config(args).block_size == args.block_size


def test_a_disk_tier_without_its_link_option_gets_the_disk_default() -> None:
    """5 GB/s, not the CPU link's 25 (a mutant taking the CPU default passed)."""
    cpu, disk = build_config(parse("--disk", "1M")).tiers
    assert (cpu.name, cpu.link_gbps, disk.name, disk.link_gbps) == ("CPU", 25.0, "DISK", 5.0)


def test_a_sweep_runs_the_capacities_given(tmp_path: Path) -> None:
    """--sweep's default capacities stand in only when no --capacity is given (a mutant
    sweeping the defaults anyway passed)."""
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=10))
    argv = [str(trace), "--block-size", str(BLOCK), "--capacity", "80", "--capacity", "160"]
    plan = plan_replay(parse_for([*argv, "--sweep", "--out", str(tmp_path / "out")]))
    assert plan.capacities == [80, 160]


@pytest.mark.parametrize("option", ["--capacity", "--cpu", "--disk", "--gpu-capacity"])
@pytest.mark.parametrize(
    "value", ["99999999999999999999M", "1000000000.000001G", "1000000000000000001"]
)
def test_a_capacity_beyond_an_exabyte_of_tokens_is_a_usage_error_naming_it(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--capacity 99999999999999999999M` was taken, and the table printed it as a 26-digit
    number."""
    with pytest.raises(SystemExit) as exit_info:
        parse(option, value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid token count {value!r}: more than 1,000,000,000,000,000,000 tokens" in err


def test_the_largest_capacity_is_taken() -> None:
    args = parse("--capacity", "1000000000G", "--disk", str(10**18), "--gpu-capacity", "1000")
    assert (args.capacity, args.disk_capacity, args.gpu_capacity) == ([10**18], 10**18, 1000)


def test_a_capacity_given_twice_is_replayed_once(tmp_path: Path) -> None:
    """--capacity is repeatable; a repeat is one capacity, as a repeated --policy is one
    policy (a mutant keeping the repeat replayed it twice)."""
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=10))
    argv = [str(trace), "--block-size", str(BLOCK), "--capacity", "80", "--capacity", "160"]
    plan = plan_replay(parse_for([*argv, "--capacity", "80"]))
    assert plan.capacities == [80, 160]


def test_a_gpu_tier_exactly_the_largest_request_is_accepted(tmp_path: Path) -> None:
    """The largest request must fit the GPU tier: exactly its size fits (a mutant refused
    it as too large)."""
    records = doc_trace(seed=5, num_requests=10)
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, records)
    gpu = max(len(r.hash_ids) for r in records) * BLOCK
    argv = [str(trace), "--block-size", str(BLOCK), "--gpu-capacity", str(gpu)]
    assert plan_replay(parse_for(argv)).base.gpu_capacity_tokens == gpu
