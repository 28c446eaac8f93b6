"""`kvtier replay`'s defaults: the options left out give the Python API's defaults, and
`--help` states each default the parser uses (README: "`kvtier replay --help` lists
every option with its default")."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES
from kvtier.replay import ReplayConfig, TierConfig, replay_trace
from kvtier.replay.cli import configure, main
from kvtier.replay.trace import write_trace


def _help_of(dest: str) -> tuple[argparse.Action, str]:
    parser = argparse.ArgumentParser(prog="kvtier replay")
    configure(parser)
    action = next(a for a in parser._actions if a.dest == dest)
    return action, " ".join((action.help or "").split())


def test_options_left_out_replay_as_the_api_defaults(tmp_path: Path) -> None:
    """The release order, the cost model (prefill speed, KV bytes per token, CPU link)
    the command uses without their options are `ReplayConfig`'s and `CostModel`'s: the
    JSON's hit ratio, bytes and TTFT equal a replay with the API's defaults. (On this
    trace each release order gives another hit ratio at 80 tokens.)"""
    records = doc_trace(seed=5, num_requests=60)
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, records)
    out = tmp_path / "r.json"
    argv = [str(trace), "--block-size", str(BLOCK), "--capacity", "80", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    row = next(p for p in json.loads(out.read_text())["points"] if p["policy"] == "lru")
    config = ReplayConfig(tiers=(TierConfig.named("CPU", 80),), block_size=BLOCK)
    expected = replay_trace(records, config)
    assert row["token_hit_ratio"] == round(expected.token_hit_ratio, 6)
    assert row["bytes_stored"] == expected.tiers[0].bytes_stored
    assert row["bytes_loaded"] == expected.tiers[0].bytes_loaded
    assert row["mean_ttft_s"] == round(expected.mean_ttft_s, 6)
    assert row["mean_ttft_no_cache_s"] == round(expected.mean_ttft_no_cache_s, 6)


@pytest.mark.parametrize(
    "dest", ["block_size", "prefill_tokens_per_s", "bytes_per_token", "cpu_link_gbps"]
)
def test_the_help_states_the_default_the_parser_uses(dest: str) -> None:
    action, text = _help_of(dest)
    stated = re.search(r"\(default ([0-9.e+]+)", text)
    assert stated is not None, text
    assert float(stated.group(1)) == action.default


def test_the_release_order_help_names_its_default() -> None:
    action, text = _help_of("release_order")
    assert action.default == "tail_first"
    assert re.search(r"tail_first \([^)]*default\)", text), text


def test_the_policy_help_names_every_eviction_and_admission_policy() -> None:
    """`all` (store everything) is what no `+ADMISSION` means: not offered by name."""
    _, text = _help_of("policy")
    listed = re.search(r"Eviction: (.*); admission: (.*); or offline", text)
    assert listed is not None, text
    assert listed.group(1).split(", ") == list(EVICTION_POLICIES)
    assert listed.group(2).split(", ") == [a for a in ADMISSION_POLICIES if a != "all"]
