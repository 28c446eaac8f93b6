"""A capacity of exactly one block is enough, for every capacity option and for the
defaults (found by a mutation run: the tests refused one token less, never the bound)."""

from __future__ import annotations

import argparse

import pytest

from kvtier.replay.cli import configure
from kvtier.replay.plan import build_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["t.jsonl", *argv])


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
