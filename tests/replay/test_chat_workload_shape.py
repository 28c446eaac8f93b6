"""The chat workload's documented parameters and shape (`kvtier.replay.generate`), found
by the first mutation run on it: changing any default, the system prompts' Zipf
exponent, the turn cap, or dropping the answer from the next turn's prompt passed every
test, though docs/policies.md's chat table is measured on the default trace of seed 0."""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.replay import generate
from kvtier.replay.generate import ChatWorkloadConfig, check_options, generate_chat_trace
from kvtier.replay.trace import read_trace, summarize


def test_the_default_trace_is_the_one_the_docs_measured() -> None:
    """Seed 0 at the defaults: 4,485 requests and an infinite-cache hit ratio of 0.865
    (docs/policies.md), 141,580 block references and 21 k distinct blocks (the module's
    docstring). The totals pin every default parameter: a changed one gives other numbers."""
    records = generate_chat_trace(ChatWorkloadConfig())
    summary = summarize(records, 512)
    assert summary.num_requests == 4_485
    assert summary.num_block_refs == 141_580
    assert summary.num_distinct_blocks == 21_058
    assert round(summary.infinite_token_hit_ratio, 3) == 0.865
    assert summary.num_prompt_tokens == 71_340_564
    assert sum(r.output_length for r in records) == 2_504_814
    assert records[-1].timestamp_ms == 4_342_713
    assert sum(r.timestamp_ms for r in records) == 4_488_907_616  # rounded to the ms
    assert summary.duration_s == 4340.389


def one_conversation(seed: int, **overrides: object) -> ChatWorkloadConfig:
    """A workload of a single conversation: its records are that conversation's turns."""
    config: dict[str, object] = {
        "seed": seed,
        "num_conversations": 1,
        "mean_turns": 6.0,
        "system_prompt_tokens": (40, 90),
        "user_tokens_median": 30,
        "answer_tokens_median": 20,
        "think_time_mean_s": 5.0,
        "decode_tokens_per_s": 10.0,
        "block_size": 16,
    }
    config.update(overrides)
    return ChatWorkloadConfig(**config)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(8))
def test_each_turn_extends_the_last_prompt_with_its_answer_and_a_message(seed: int) -> None:
    """Turn k+1's prompt is turn k's prompt, its answer, then a new user message (at
    least one token); it arrives no sooner than the answer took to decode."""
    config = one_conversation(seed)
    turns = generate_chat_trace(config)
    for before, after in itertools.pairwise(turns):
        assert after.input_length > before.input_length + before.output_length
        full = before.input_length // config.block_size
        assert after.hash_ids[:full] == before.hash_ids[:full]
        decoded_ms = 1000 * before.output_length / config.decode_tokens_per_s
        assert after.timestamp_ms >= before.timestamp_ms + decoded_ms - 1


def test_no_conversation_runs_past_max_turns() -> None:
    """`max_turns` caps the geometric number of turns (here it would average 1000)."""
    for seed in range(5):
        turns = generate_chat_trace(one_conversation(seed, mean_turns=1000.0, max_turns=4))
        assert len(turns) == 4


def test_mean_turns_sets_the_geometric_mean() -> None:
    """Turns are geometric with mean `mean_turns` (at least one): 400 conversations of
    mean 4 average 4 turns each, within sampling noise."""
    config = ChatWorkloadConfig(
        num_conversations=400,
        mean_turns=4.0,
        max_turns=1000,
        system_prompt_tokens=(8, 8),
        user_tokens_median=4,
        answer_tokens_median=4,
        block_size=64,
    )
    assert 3.6 < len(generate_chat_trace(config)) / 400 < 4.4


def test_the_system_prompts_are_chosen_by_zipf_popularity() -> None:
    """With exponent 3 the more popular of two system prompts (weight 1 against 1/8)
    starts about 8/9 of the conversations; the default 1.1 would give 0.68, a uniform
    choice 0.5. The first block of a prompt (all system prompt) names which it is."""
    config = ChatWorkloadConfig(
        num_conversations=900,
        num_system_prompts=2,
        system_prompt_tokens=(16, 16),
        system_prompt_zipf=3.0,
        max_turns=1,
        block_size=8,
    )
    firsts = Counter(r.hash_ids[0] for r in generate_chat_trace(config))
    assert len(firsts) == 2
    assert 0.83 < max(firsts.values()) / 900 < 0.95


@pytest.mark.parametrize("median", [1, 2])
def test_every_message_and_answer_has_a_token(median: int) -> None:
    """Lognormal lengths are rounded but never to 0: with a median of 1 or 2 tokens, a
    third of the draws would round to 0 without the floor."""
    config = ChatWorkloadConfig(
        num_conversations=50, user_tokens_median=median, answer_tokens_median=median
    )
    records = generate_chat_trace(config)
    assert min(r.output_length for r in records) >= 1


def test_check_options_takes_exactly_the_largest_trace() -> None:
    """100,000 conversations at 121-token blocks make 100,000,000 block references: the
    bound itself is allowed, one conversation more is not."""
    at_bound = argparse.Namespace(seed=0, conversations=100_000, block_size=121)
    check_options(at_bound)  # no error
    with pytest.raises(ValueError, match="at most 100,000,000"):
        check_options(argparse.Namespace(seed=0, conversations=100_000, block_size=120))


def test_the_seed_option_chooses_the_trace(tmp_path: Path) -> None:
    """`--seed 5` writes the trace of seed 5, not of the default seed."""
    out = tmp_path / "chat.jsonl"
    assert main(["generate", str(out), "--conversations", "3", "--seed", "5"]) == 0
    expected = generate_chat_trace(ChatWorkloadConfig(seed=5, num_conversations=3))
    assert read_trace(out) == expected
    assert expected != generate_chat_trace(ChatWorkloadConfig(seed=0, num_conversations=3))


@pytest.mark.parametrize(
    ("value", "error"),
    [("-3", "must be 0 ... 18446744073709551615, got -3"), ("-1e3", "invalid integer '-1e3'")],
)
def test_a_dashed_seed_is_named_with_what_is_wrong(
    value: str, error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--seed -3` is refused naming the range, `--seed -1e3` as no integer; not as an
    option given no value (argparse reads `-1e3` after `--seed` as an option unless it
    is joined as `--seed=-1e3`)."""
    with pytest.raises(SystemExit):
        generate.main([str(tmp_path / "chat.jsonl"), "--seed", value])
    assert f"argument --seed: {error}" in capsys.readouterr().err


def test_ctrl_c_while_generating_exits_130_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the trace is made ends with status 130 and one line on stderr."""

    def interrupted(config: ChatWorkloadConfig) -> list[object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "_generate_with_progress", interrupted)
    out = tmp_path / "chat.jsonl"
    assert generate.main([str(out)]) == 130
    assert capsys.readouterr().err.endswith(": interrupted\n")
    assert not out.exists()
