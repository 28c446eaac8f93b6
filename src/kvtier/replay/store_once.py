"""An argparse action for a single-valued option that refuses to be given twice."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# The namespace attribute that records which options were given (dest -> value): state of
# one parse, so one parser can parse many command lines.
_GIVEN = "_store_once_given"


class StoreOnce(argparse.Action):
    """Store an option's value like `store`, but make a second occurrence a usage error.

    argparse's `store` keeps the last value of a repeated option, so `--json a --json b`
    silently writes only `b`. The error names the option and both values (exit status 2).
    Use it as `parser.add_argument("--json", action=StoreOnce)`.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given: dict[str, Any] = getattr(namespace, _GIVEN, None) or {}
        if self.dest in given:
            raise argparse.ArgumentError(
                self, f"given twice ({given[self.dest]!r}, then {values!r}): give it once"
            )
        given[self.dest] = values
        setattr(namespace, _GIVEN, given)
        setattr(namespace, self.dest, values)
