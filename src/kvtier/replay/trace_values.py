"""A trace's bad value named in an error as written in the file (`true`, `1e400`, `null`),
not as Python shows what `json.loads` made of it (`True`, `inf`, `None`).

Only an error's path calls it: it decodes the line a second time, keeping each number
that is not an int (`1E2`, `1e400`, `NaN`) as its text, so reading a valid trace costs
nothing more.
"""

from __future__ import annotations

import json

MAX_CHARS = 60  # a longer value is cut there and ends with " ..."


def value_as_written(line: str, read: object, *keys: str | int) -> str:
    """Return the value at `keys` (field names, list positions) of the JSON text `line` as
    written there, cut to MAX_CHARS; `read` is what the reader's `json.loads` made of
    `line` (valid JSON holding that value).

    Numbers that are not ints and the words (`true`, `null`) come out as written;
    strings, lists and objects are written again (JSON escapes and spacing may differ).
    A line the reader decoded only just under the recursion limit cannot be decoded again
    here, deeper in the stack: the value is then rendered from `read` (a number that is
    not an int as Python's `json` writes it: `1E2` as `100.0`).
    """
    try:
        value = json.loads(line, parse_float=_Written, parse_constant=_Written)
    except RecursionError:
        value = read
    for key in keys:
        value = value[key]
    return _shortened(value)


class _Written(str):
    """A number's text as written in the file."""


class _FullError(Exception):
    """The rendered text passed MAX_CHARS."""


def _shortened(value: object) -> str:
    """Render `value` as JSON up to MAX_CHARS (and no deeper, however nested it is)."""
    parts: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        parts.append(text)
        size += len(text)
        if size > MAX_CHARS:
            raise _FullError

    def walk(item: object) -> None:  # each level puts a character: depth <= MAX_CHARS + 1
        if isinstance(item, _Written):
            put(str(item))
        elif isinstance(item, list):
            put("[")
            for i, element in enumerate(item):
                put(", " if i else "")
                walk(element)
            put("]")
        elif isinstance(item, dict):
            put("{")
            for i, (name, element) in enumerate(item.items()):
                put(", " if i else "")
                put(json.dumps(name, ensure_ascii=False) + ": ")
                walk(element)
            put("}")
        else:  # an int, a string, true, false or null
            put(json.dumps(item, ensure_ascii=False))

    try:
        walk(value)
    except _FullError:
        return "".join(parts)[:MAX_CHARS] + " ..."
    return "".join(parts)
