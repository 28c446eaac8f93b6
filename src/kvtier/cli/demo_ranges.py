"""The ranges of `kvtier demo`'s options, checked without importing the engine.

`kvtier demo --turns 0` is refused before torch is imported (about 3 s), as argparse
refuses a value that is not a number.
"""

from __future__ import annotations

import argparse

# The least value of each numeric option (message lengths may be 0, not all of them).
OPTION_MINIMUMS = {
    "conversations": 1,
    "turns": 1,
    "system_tokens": 0,
    "document_tokens": 0,
    "user_tokens": 0,
    "answer_tokens": 1,
    "gpu_blocks": 2,
    "block_size": 1,
    "cpu_mib": 1,
    "disk_mib": 1,
    "cascade_cpu_mib": 1,
}
# The most turns (conversations x turns) one run serves: every configuration serves each
# one as a request on the CPU engine, and every conversation's history is held at once.
MAX_TURNS = 10_000


def check_options(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option out of range."""
    for option, least in OPTION_MINIMUMS.items():
        value = getattr(args, option)
        if value < least:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.conversations * args.turns > MAX_TURNS:
        raise ValueError(
            f"--conversations={args.conversations} x --turns={args.turns} is "
            f"{args.conversations * args.turns} turns; the demo serves at most {MAX_TURNS} per"
            " configuration (each is a request on the CPU engine, in every configuration)"
        )
    if args.system_tokens + args.document_tokens + args.user_tokens == 0:
        raise ValueError(
            "--system-tokens, --document-tokens and --user-tokens are all 0: the first"
            " prompt would be empty"
        )
    if args.cascade == "write_through" and args.cascade_cpu_mib > args.disk_mib:
        raise ValueError(
            f"--cascade-cpu-mib={args.cascade_cpu_mib} is larger than --disk-mib="
            f"{args.disk_mib}: with --cascade write_through the disk keeps a copy of every"
            " CPU block; raise --disk-mib, lower --cascade-cpu-mib, or use --cascade write_back"
        )
