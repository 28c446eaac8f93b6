"""A single-valued option of `kvtier demo` given twice is a usage error naming it; argparse
kept the last value, silently (`--turns 2 ... --turns 20` served twenty turns)."""

from __future__ import annotations

import argparse

import pytest

from kvtier.cli.main import build_parser
from kvtier.replay.store_once import StoreOnce

# Every option of `kvtier demo`, with two values it accepts.
DEMO_OPTIONS = [
    ("--model-dir", "a", "b"),
    ("--conversations", "2", "3"),
    ("--turns", "2", "3"),
    ("--system-tokens", "16", "32"),
    ("--document-tokens", "16", "32"),
    ("--user-tokens", "16", "32"),
    ("--answer-tokens", "4", "8"),
    ("--gpu-blocks", "8", "16"),
    ("--block-size", "8", "16"),
    ("--cpu-mib", "1", "2"),
    ("--disk-mib", "1", "2"),
    ("--cascade-cpu-mib", "1", "2"),
    ("--cascade", "write_back", "write_through"),
    ("--disk-dir", "a", "b"),
    ("--disk-io", "direct", "page_cache"),
    ("--out", "a", "b"),
]


def demo_parser() -> argparse.ArgumentParser:
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = subparsers.choices["demo"]
    return parser


@pytest.mark.parametrize(("option", "first", "second"), DEMO_OPTIONS)
def test_a_demo_option_given_twice_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], option: str, first: str, second: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo_parser().parse_args([f"{option}={first}", option, second])  # never serves
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"kvtier demo: error: argument {option}: given twice (" in err
    assert f"then {second!r})" in err or f"then {second})" in err


def test_every_demo_option_refuses_a_repeat() -> None:
    """A new demo option must use StoreOnce too (and be listed above)."""
    options = {
        action.option_strings[0]: action
        for action in demo_parser()._actions
        if action.option_strings and action.option_strings[0] not in ("-h", "-v")
    }  # -h and -v (`kvtier`'s own, repeated here) are flags: a repeat changes nothing
    assert set(options) == {option for option, _, _ in DEMO_OPTIONS}
    for option, action in options.items():
        assert isinstance(action, StoreOnce), option


# The demo's numeric options: the sizes, all integers.
DEMO_NUMBERS = [option for option, first, _ in DEMO_OPTIONS if first.isdigit()]
# Arabic-Indic, full-width, mixed 16; and 16 with Python's digit separator (int() reads it)
NOT_DIGITS = ["\u0661\u0666", "\uff11\uff16", "1\u06f6", "1_6"]


@pytest.mark.parametrize("text", NOT_DIGITS)
@pytest.mark.parametrize("option", DEMO_NUMBERS)
def test_a_demo_number_in_other_digits_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], text: str, option: str
) -> None:
    # Regression: int() reads other scripts' digits, so Arabic-Indic --turns 16 ran 16 turns.
    with pytest.raises(SystemExit) as exit_info:
        demo_parser().parse_args([option, text])  # never serves
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"kvtier demo: error: argument {option}: invalid integer {text!r}: use digits" in err


def test_only_path_options_of_the_demo_accept_other_scripts_digits() -> None:
    """A new numeric demo option must parse with ascii_int / ascii_float too."""
    parser = demo_parser()
    for text in NOT_DIGITS:
        taken = set()
        for option, _, _ in DEMO_OPTIONS:
            try:
                parser.parse_args([option, text])
            except SystemExit:
                continue
            taken.add(option)
        assert taken == {"--model-dir", "--disk-dir", "--out"}, text


@pytest.mark.parametrize("user_value", [None, "ACTIVE"])
def test_the_demo_makes_openmp_threads_sleep_unless_the_user_chose(
    user_value: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OMP_WAIT_POLICY` is set before the demo imports torch; a user's value stays."""
    import os

    import kvtier.cli.demo as demo

    seen: list[str | None] = []
    monkeypatch.setattr(
        demo, "run_demo", lambda args: seen.append(os.environ.get("OMP_WAIT_POLICY")) or 0
    )
    monkeypatch.setenv("OMP_WAIT_POLICY", user_value or "")  # restored after the test
    if user_value is None:
        monkeypatch.delenv("OMP_WAIT_POLICY")
    args = demo_parser().parse_args([])
    assert args.run(args) == 0
    assert seen == [user_value or "PASSIVE"]


def test_the_help_of_a_demo_option_with_choices_explains_each_choice() -> None:
    # Regression: --disk-io's help said "disk tier I/O mode (default direct)", leaving
    # page_cache, and what direct requires, unexplained.
    for action in demo_parser()._actions:
        for choice in action.choices or ():
            assert f"{choice} (" in (action.help or ""), (action.option_strings, choice)


# What each choice does, as the README's configuration table says: a word its
# explanation in `kvtier demo --help` must hold.
CHOICE_MEANINGS = {
    "write_through": "every block at once",
    "write_back": "about to evict",
    "direct": "O_DIRECT",
    "page_cache": "buffered",
}


def test_the_help_explains_each_choice_by_what_it_does() -> None:
    """Found by a mutation run (s32): --cascade's (or --disk-io's) help could explain
    write_through as write_back does, and the reverse, with every test passing."""
    explained = {}
    for action in demo_parser()._actions:
        text = " ".join((action.help or "").split())
        for choice in action.choices or ():
            explained[choice] = text.split(f"{choice} (", 1)[1].split(")", 1)[0]
    assert explained.keys() == CHOICE_MEANINGS.keys()
    for choice, meaning in CHOICE_MEANINGS.items():
        assert meaning in explained[choice], (choice, explained[choice])


def test_the_help_of_each_tier_size_names_its_tier() -> None:
    """Found by a mutation run (s32): --cpu-mib's help could say "disk tier size" with
    every test passing."""
    helps = {action.dest: action.help or "" for action in demo_parser()._actions}
    assert helps["cpu_mib"].startswith("CPU tier size in MiB")
    assert helps["disk_mib"].startswith("disk tier size in MiB")
    assert helps["cascade_cpu_mib"].startswith("CPU tier size in front of the disk tier")


def test_the_help_of_each_numeric_demo_option_states_its_least_value() -> None:
    # Regression: the help gave no range, so nothing told a user that --system-tokens 0 is
    # taken but --answer-tokens 0, --cpu-mib 0 or --gpu-blocks 1 are refused.
    from kvtier.cli.demo_ranges import OPTION_MINIMUMS

    helps = {action.dest: action.help or "" for action in demo_parser()._actions}
    for option, least in OPTION_MINIMUMS.items():
        assert f"at least {least}" in helps[option], (option, helps[option])
