"""`python -m kvtier.replay TRACE ...`: the same as `kvtier replay`, on the same path
(`kvtier.replay.command.run_command`), which imports the command's modules where a
Ctrl-C is one line and status 130."""

from __future__ import annotations

import sys

from kvtier.replay.command import run_command

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Return the arguments of `argv` for `kvtier replay` run on its own."""
    from kvtier.replay.cli import parse_arguments  # on the command's path (see above)

    return parse_arguments(argv)


sys.exit(run_command(sys.argv[1:], ends_the_process=True, parse=_parse))
