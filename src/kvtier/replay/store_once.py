"""An argparse action for a single-valued option that refuses to be given twice."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

# The namespace attribute that records which options were given (dest -> text as typed):
# state of one parse, so one parser can parse many command lines.
_GIVEN = "_store_once_given"


class StoreOnce(argparse.Action):
    """Store an option's value like `store`, but make a second occurrence a usage error.

    argparse's `store` keeps the last value of a repeated option, so `--json a --json b`
    silently writes only `b`. The error names the option and both values as typed
    (`--json -`, not the `/dev/stdout` it stands for; exit status 2).
    Use it as `parser.add_argument("--json", action=StoreOnce)`.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, type: Any = None, **kwargs: Any
    ) -> None:
        if type is not None:
            type = _KeepsText(type)
        super().__init__(option_strings, dest, type=type, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        text = self.type.as_typed(values) if isinstance(self.type, _KeepsText) else values
        given: dict[str, Any] = getattr(namespace, _GIVEN, None) or {}
        if self.dest in given:
            raise argparse.ArgumentError(
                self, f"given twice ({given[self.dest]!r}, then {text!r}): give it once"
            )
        given[self.dest] = text
        setattr(namespace, _GIVEN, given)
        setattr(namespace, self.dest, values)


class _KeepsText:
    """An argparse `type` that keeps the texts it converted, for `StoreOnce`'s error.

    It carries the wrapped type's `__name__`, which argparse names in an "invalid ...
    value" error.
    """

    def __init__(self, convert: Callable[[str], Any]) -> None:
        self.convert = convert
        # (value, text) of each conversion since the action last took them: argparse
        # converts an occurrence's texts just before it calls the action, and a string
        # default after the last one.
        self.converted: list[tuple[Any, str]] = []
        self.__name__ = getattr(convert, "__name__", repr(convert))

    def __call__(self, text: str) -> Any:
        value = self.convert(text)
        self.converted.append((value, text))
        return value

    def as_typed(self, values: Any) -> Any:
        """Return `values`, what argparse hands the action, as typed: the text of each
        value converted for this occurrence (all of a list, for `nargs`), else `values`
        itself (a `const` or a default, which no text of this occurrence made)."""
        converted, self.converted = self.converted, []
        items = values if isinstance(values, list) else [values]
        if not items or len(converted) < len(items):
            return values
        last = converted[-len(items) :]
        if any(c is not v for (c, _), v in zip(last, items, strict=True)):
            return values
        texts = [text for _, text in last]
        return texts if isinstance(values, list) else texts[0]
