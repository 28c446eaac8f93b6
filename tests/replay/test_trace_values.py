"""A trace's bad value is named as written in the file, cut short however large or deep."""

from __future__ import annotations

import json

from kvtier.replay.trace_values import MAX_CHARS, value_as_written


def written_as(line: str, *keys: str | int) -> str:
    return value_as_written(line, json.loads(line), *keys)


def test_numbers_and_words_read_as_written() -> None:
    line = '{"a": [1E2, -0.50, 1e400, NaN, -Infinity, true, null, "\\u00e9", 7]}'
    written = [written_as(line, "a", i) for i in range(9)]
    assert written == ["1E2", "-0.50", "1e400", "NaN", "-Infinity", "true", "null", '"é"', "7"]
    assert written_as('{"a": [1E2, true], "b": {}}') == '{"a": [1E2, true], "b": {}}'


def test_a_long_or_deep_value_is_cut_short() -> None:
    deep = "[" * 900 + "]" * 900  # json.loads reads it; deeper is "nested too deeply"
    assert written_as(deep) == "[" * MAX_CHARS + " ..."
    long = "[" + ", ".join(["123"] * 100_000) + "]"
    text = written_as(long)
    assert text == ("[" + ", ".join(["123"] * 20))[:MAX_CHARS] + " ..."


def test_a_line_too_deep_to_decode_again_is_rendered_from_what_the_reader_read() -> None:
    """The reader decoded the line a few calls shallower, only just under the recursion
    limit (see test_trace's test_a_bad_value_nested_as_deep_as_the_reader_reads_is_named)."""
    too_deep = '{"a": [1E2, ' + "[" * 100_000 + "]" * 100_000 + "]}"
    read = {"a": [100.0, [[[]]]]}
    assert value_as_written(too_deep, read, "a") == "[100.0, [[[]]]]"


def test_a_value_of_exactly_max_chars_is_shown_whole() -> None:
    """The cut starts past MAX_CHARS characters (a mutation run moved it to MAX_CHARS
    itself and no test saw)."""
    fits = '"' + "x" * (MAX_CHARS - 2) + '"'
    assert written_as(fits) == fits
    longer = '"' + "x" * (MAX_CHARS - 1) + '"'
    assert written_as(longer) == longer[:MAX_CHARS] + " ..."
