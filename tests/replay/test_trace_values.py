"""A trace's bad value is named as written in the file, cut short however large or deep."""

from __future__ import annotations

from kvtier.replay.trace_values import MAX_CHARS, value_as_written


def test_numbers_and_words_read_as_written() -> None:
    line = '{"a": [1E2, -0.50, 1e400, NaN, -Infinity, true, null, "\\u00e9", 7]}'
    written = [value_as_written(line, "a", i) for i in range(9)]
    assert written == ["1E2", "-0.50", "1e400", "NaN", "-Infinity", "true", "null", '"é"', "7"]
    assert value_as_written('{"a": [1E2, true], "b": {}}') == '{"a": [1E2, true], "b": {}}'


def test_a_long_or_deep_value_is_cut_short() -> None:
    deep = "[" * 900 + "]" * 900  # json.loads reads it; deeper is "nested too deeply"
    assert value_as_written(deep) == "[" * MAX_CHARS + " ..."
    long = "[" + ", ".join(["123"] * 100_000) + "]"
    text = value_as_written(long)
    assert text == ("[" + ", ".join(["123"] * 20))[:MAX_CHARS] + " ..."
