"""Helpers of the CLI edge and signal tests: what a signal handler is under kvtier's
wrapper, and which hidden (temporary) files a folder holds."""

from __future__ import annotations

import signal
from pathlib import Path


def unwrapped(signum: int) -> object:
    """Return the handler in place for `signum`, seen through `signals_deferred`'s wrapper."""
    handler = signal.getsignal(signum)
    return getattr(handler, "inner", handler)


def hidden_files(folder: Path) -> list[str]:
    """Return the names of `folder`'s hidden files (a write's temporaries), sorted."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
