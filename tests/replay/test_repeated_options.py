"""A single-valued option of `kvtier replay` or of the trace generator given twice is a usage
error naming it; argparse kept the last value, silently (`--json a --json b` wrote only b)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay import generate
from kvtier.replay.cli import configure, main
from kvtier.replay.option_types import parse_tokens
from kvtier.replay.store_once import StoreOnce
from kvtier.replay.trace import write_trace

# Every single-valued option of `kvtier replay`, with two values it accepts.
REPLAY_OPTIONS = [
    ("--json", "a.json", "b.json"),
    ("--out", "a", "b"),
    ("--gpu-capacity", "1M", "2M"),
    ("--disk-capacity", "1M", "2M"),
    ("--cascade", "write_back", "write_through"),
    ("--block-size", "8", "16"),
    ("--release-order", "scheduler", "tail_first"),
    ("--prefill-tokens-per-s", "1000", "2000"),
    ("--bytes-per-token", "100", "200"),
    ("--cpu-link-gbps", "10", "20"),
    ("--disk-link-gbps", "1", "2"),
]


def expect_usage_error(capsys: pytest.CaptureFixture[str], run: object, *parts: str) -> None:
    assert callable(run)
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for part in parts:
        assert part in err


@pytest.mark.parametrize(("option", "first", "second"), REPLAY_OPTIONS)
def test_a_replay_option_given_twice_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, first: str, second: str
) -> None:
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=10))
    argv = [str(trace), "--quiet", "--capacity", "80", option, first, option, second]
    expect_usage_error(capsys, lambda: main(argv), f"argument {option}", ": given twice (")


def test_two_json_paths_write_neither(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=10))
    argv = [str(trace), "--quiet", "--block-size", str(BLOCK), "--capacity", "80"]
    argv += ["--json", str(tmp_path / "a.json"), "--json", str(tmp_path / "b.json")]
    expect_usage_error(
        capsys, lambda: main(argv), f"argument --json: given twice ('{tmp_path}/a.json', then"
    )
    assert list(tmp_path.iterdir()) == [trace]


@pytest.mark.parametrize(
    ("option", "first", "second"),
    [("--json", "-", "x.json"), ("--gpu-capacity", "1k", "1k"), ("--block-size", "016", "16")],
)
def test_a_repeat_names_both_values_as_typed(
    capsys: pytest.CaptureFixture[str], option: str, first: str, second: str
) -> None:
    """Regression: the error showed the values converted (`'/dev/stdout'` for `--json -`,
    `1000` for `1k`), which the user never typed."""
    parser = argparse.ArgumentParser()
    configure(parser)
    argv = ["t.jsonl", option, first, option, second]
    expect_usage_error(
        capsys,
        lambda: parser.parse_args(argv),
        f"argument {option}: given twice ({first!r}, then {second!r}): give it once",
    )


def test_an_alias_and_its_option_count_as_the_same_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    argv = ["t.jsonl", "--disk", "1M", "--disk-capacity", "2M"]
    expect_usage_error(
        capsys, lambda: parser.parse_args(argv), "argument --disk-capacity/--disk: given twice"
    )


def test_repeatable_options_stay_repeatable_and_a_parser_parses_many_times() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    argv = ["t.jsonl", "--policy", "lru", "--policy", "arc", "--capacity", "1M", "--cpu", "2M"]
    for _ in range(2):  # what one parse recorded does not make the next one's --json a repeat
        args = parser.parse_args([*argv, "--json", "r.json"])
        assert args.policy == ["lru", "arc"]
        assert args.capacity == [1_000_000, 2_000_000]
        assert args.json == "r.json"


def test_every_single_valued_replay_option_refuses_a_repeat() -> None:
    """A new single-valued option must use StoreOnce too (and be listed above)."""
    parser = argparse.ArgumentParser()
    configure(parser)
    single = {
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.nargs is None and not action.const
    }
    single -= {"--policy", "--capacity", "-h"}
    assert single == {option for option, _, _ in REPLAY_OPTIONS}
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] in single:
            assert isinstance(action, StoreOnce), action.option_strings


@pytest.mark.parametrize("option", ["--seed", "--conversations", "--block-size"])
def test_a_generator_option_given_twice_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    out = tmp_path / "chat.jsonl"
    argv = [str(out), option, "3", option, "4"]
    expect_usage_error(
        capsys, lambda: generate.main(argv), f"argument {option}: given twice ('3', then '4')"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "both"),
    [
        (["--pair", "1k", "2k", "--pair", "3k", "4k"], "(['1k', '2k'], then ['3k', '4k'])"),
        (["--level", "5k", "--level"], "('5k', then 7)"),  # the second is `const`
        (["--level", "--level", "5k"], "(7, then '5k')"),
        # `const` equal to the earlier text's value: still not that text (a mutant that
        # kept the texts of earlier occurrences named '7' twice)
        (["--level", "7", "--level"], "('7', then 7)"),
    ],
)
def test_a_repeat_of_a_multi_or_optional_valued_option_names_what_was_given(
    capsys: pytest.CaptureFixture[str], argv: list[str], both: str
) -> None:
    """Regression: StoreOnce named the text its type converted last: only the last of
    the values of `nargs=2`, and for a `const` (no text converted) the text of an
    earlier occurrence, or None."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", action=StoreOnce, type=parse_tokens, nargs=2)
    parser.add_argument("--level", action=StoreOnce, type=parse_tokens, nargs="?", const=7)
    expect_usage_error(capsys, lambda: parser.parse_args(argv), f"given twice {both}:")


def test_a_policy_named_twice_is_replayed_once(tmp_path: Path) -> None:
    """--policy is repeatable: a repeat (as typed, or in another case) is one policy, and
    the reference lines are not doubled by naming them (a mutation run found no test)."""
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=10))
    out = tmp_path / "r.json"
    argv = [str(trace), "--quiet", "--block-size", str(BLOCK), "--capacity", "80"]
    argv += ["--policy", "arc", "--policy", "ARC", "--policy", "lru", "--json", str(out)]
    assert main(argv) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["policy"] for p in points] == ["arc", "lru", "belady"]


@pytest.mark.parametrize(
    ("argv", "both"),
    [
        (["--size", "2k", "--size", "3k"], "('2k', then '3k')"),
        (["--size", "--size", "3k"], "(7, then '3k')"),  # the first is `const`
    ],
)
def test_a_string_default_converted_by_an_earlier_parse_is_not_named(
    capsys: pytest.CaptureFixture[str], argv: list[str], both: str
) -> None:
    """argparse converts a string default when the option is not given (`kvtier demo`'s
    --out has one): a parse without the option leaves that text among the type's
    conversions. A later parse's repeat names its own texts, or the `const`, not it."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--size", action=StoreOnce, type=parse_tokens, nargs="?", const=7, default="5k"
    )
    assert parser.parse_args([]).size == 5000
    expect_usage_error(capsys, lambda: parser.parse_args(argv), f"given twice {both}:")
