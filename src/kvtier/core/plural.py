"""Counts in messages: "1 request", "2 requests" (not "1 requests")."""

from __future__ import annotations


def counted(number: int, noun: str) -> str:
    """Return `number` and `noun`, with an s unless `number` is one: "1 usable block",
    "78 blocks"."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
