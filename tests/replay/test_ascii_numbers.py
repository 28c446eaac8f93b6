"""Every numeric option of `kvtier replay` and of the trace generator takes ASCII digits
only: int() and float() read other scripts' digits, so Arabic-Indic 16 ran as 16. They
read `1_000` too, which the message ("use digits 0-9") and the token counts refused."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from kvtier.replay import generate
from kvtier.replay.ascii_number import ascii_float, ascii_int
from kvtier.replay.cli import configure

NOT_DIGITS = [
    "\u0661\u0666",  # Arabic-Indic 16
    "\uff11\uff16",  # full-width 16
    "1\u06f6",  # an Extended Arabic-Indic 6 after an ASCII 1
    "\u00a016",  # 16 after a no-break space
    "1_6",  # Python's digit separator: `--conversations 1_000` ran 1000
]


def replay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier replay")
    configure(parser)
    return parser


def options_taking_a_value(parser: argparse.ArgumentParser) -> list[str]:
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.nargs is None and action.const is None
    ]


def accepts(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    try:
        parser.parse_args(argv)
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize("text", ["16", " 16 ", "-3", "+2", "007"])
def test_ascii_int_reads_what_int_reads_in_ascii(text: str) -> None:
    assert ascii_int(text) == int(text)


@pytest.mark.parametrize("text", ["2.5", "-1e9", ".5", "inf", "nan"])
def test_ascii_float_reads_what_float_reads_in_ascii(text: str) -> None:
    assert repr(ascii_float(text)) == repr(float(text))


@pytest.mark.parametrize("text", [*NOT_DIGITS, "\uff12.\uff15", "2\u0662.5", "2_0.5", "1e1_0"])
@pytest.mark.parametrize(("parse", "what"), [(ascii_int, "integer"), (ascii_float, "number")])
def test_other_scripts_digits_and_underscores_are_refused_naming_the_value(
    text: str, parse: Callable[[str], float], what: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    assert str(error.value).startswith(f"invalid {what} {text!r}: use digits 0-9")


@pytest.mark.parametrize("text", NOT_DIGITS)
@pytest.mark.parametrize(
    ("option", "what"),
    [
        ("--block-size", "integer"),
        ("--bytes-per-token", "integer"),
        ("--prefill-tokens-per-s", "number"),
        ("--cpu-link-gbps", "number"),
        ("--disk-link-gbps", "number"),
    ],
)
def test_a_replay_number_in_other_digits_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], text: str, option: str, what: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        replay_parser().parse_args(["t.jsonl", option, text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"kvtier replay: error: argument {option}: invalid {what} {text!r}: use digits" in err


@pytest.mark.parametrize("text", NOT_DIGITS)
@pytest.mark.parametrize("option", ["--seed", "--conversations", "--block-size"])
def test_a_generator_number_in_other_digits_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str], text: str, option: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate.build_parser().parse_args(["chat.jsonl", option, text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: invalid integer {text!r}: use digits 0-9\n" in err


def test_only_path_options_accept_other_scripts_digits() -> None:
    """A new numeric option must parse with ascii_int / ascii_float too."""
    replay, generator = replay_parser(), generate.build_parser()
    for text in NOT_DIGITS:
        taken = {o for o in options_taking_a_value(replay) if accepts(replay, ["t", o, text])}
        assert taken == {"--out", "--json"}, text
        taken = {o for o in options_taking_a_value(generator) if accepts(generator, ["t", o, text])}
        assert taken == set(), text
