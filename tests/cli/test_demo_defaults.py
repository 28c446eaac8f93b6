"""`kvtier demo`'s defaults (what `make demo` runs) pass its checks and exercise every tier,
and its help states each default as it is.

Found by a mutation run (s29): a default could change (--turns 60, --cpu-mib 1,
--cascade-cpu-mib 64, --cascade write_back, --disk-io page_cache) or disagree with the
help (which hard-codes "default 32" and "default direct") with every test passing: the
tests run the demo with their own sizes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from test_demo_options import demo_parser

from kvtier.cli.demo import MIB, _setup
from kvtier.cli.demo_checks import check_positions, check_sizes
from kvtier.cli.demo_ranges import check_options
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import OffloadConfig


def test_the_help_states_each_default_as_the_parser_has_it() -> None:
    for action in demo_parser()._actions:
        if action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            continue
        text = (action.help or "") % {"default": action.default}
        shown = f"./{action.default}" if action.dest == "out" else action.default
        assert f"default {shown}" in text, (action.option_strings, text)


def test_the_cascade_and_disk_io_defaults_are_the_config_keys() -> None:
    args, config = demo_parser().parse_args([]), OffloadConfig(cpu_bytes=MIB)
    assert (args.cascade, args.disk_io) == (config.cascade.value, config.disk_io_mode.value)


def test_the_defaults_pass_the_checks_and_send_histories_to_every_tier(tmp_path: Path) -> None:
    args = demo_parser().parse_args([])
    check_options(args)
    engine = EngineConfig(block_size=args.block_size, num_gpu_blocks=args.gpu_blocks)
    with LLM(ModelConfig.demo(), engine=engine) as llm:
        layout, config = llm.layout, llm.model_config
    workload, configs = _setup(args, config.vocab_size, str(tmp_path / "disk"))
    check_positions(workload, config.max_position)
    check_sizes(workload, configs, layout, args.gpu_blocks)
    # Every conversation's history at its last turn, in blocks: what the tiers may hold.
    per_conversation = -(-workload.max_sequence_tokens // args.block_size)
    history = workload.num_conversations * per_conversation * layout.bytes_per_block
    assert history > (args.gpu_blocks - 1) * layout.bytes_per_block  # histories leave the GPU
    assert args.cpu_mib * MIB >= history  # ... and the CPU tier keeps them all
    assert args.disk_mib * MIB >= history  # ... and so does the disk tier
    # "smaller than the demo's KV, so CPU evictions are demoted and served from disk"
    assert args.cascade_cpu_mib * MIB < history


NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def test_the_readme_states_the_defaults_make_demo_runs_with() -> None:
    """The README says `make demo` serves "eight conversations" with a cascade CPU tier of
    "32 MiB by default". Found by a mutation run (s32): --conversations' default could
    change (9) with every test passing, the README then describing another demo."""
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    args = demo_parser().parse_args([])
    assert f"{NUMBER_WORDS[args.conversations]} conversations, each" in readme
    assert f"the CPU+disk cascade, {args.cascade_cpu_mib} MiB by default" in readme
