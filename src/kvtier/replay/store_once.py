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
        # argparse converts an option's text with `type` just before it calls the action.
        text = self.type.text if isinstance(self.type, _KeepsText) else values
        given: dict[str, Any] = getattr(namespace, _GIVEN, None) or {}
        if self.dest in given:
            raise argparse.ArgumentError(
                self, f"given twice ({given[self.dest]!r}, then {text!r}): give it once"
            )
        given[self.dest] = text
        setattr(namespace, _GIVEN, given)
        setattr(namespace, self.dest, values)


class _KeepsText:
    """An argparse `type` that keeps the text it converted last, for `StoreOnce`'s error.

    It carries the wrapped type's `__name__`, which argparse names in an "invalid ...
    value" error.
    """

    def __init__(self, convert: Callable[[str], Any]) -> None:
        self.convert = convert
        self.text: str | None = None
        self.__name__ = getattr(convert, "__name__", repr(convert))

    def __call__(self, text: str) -> Any:
        self.text = text
        return self.convert(text)
