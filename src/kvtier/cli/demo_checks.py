"""What `kvtier demo` checks before serving: option ranges, and that everything fits.

Each check raises ValueError with a message naming the option to change, so a bad value
stops the demo at once with that message instead of a traceback minutes into a run.
"""

from __future__ import annotations

import argparse

from kvtier.core.kv_groups import KVLayout
from kvtier.engine.chat_workload import ChatWorkload
from kvtier.offload.config import ConfigError, OffloadConfig
from kvtier.offload.plan import Tier

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
# The option that sizes each run's tier budget: (run name, config field) -> option.
TIER_OPTIONS = {
    ("CPU tier", "cpu_bytes"): "--cpu-mib",
    ("disk tier", "disk_bytes"): "--disk-mib",
    ("CPU+disk", "cpu_bytes"): "--cascade-cpu-mib",
    ("CPU+disk", "disk_bytes"): "--disk-mib",
}


def check_options(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option out of range."""
    for option, least in OPTION_MINIMUMS.items():
        value = getattr(args, option)
        if value < least:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.system_tokens + args.document_tokens + args.user_tokens == 0:
        raise ValueError(
            "--system-tokens, --document-tokens and --user-tokens are all 0: the first"
            " prompt would be empty"
        )


def check_sizes(
    workload: ChatWorkload,
    configs: list[tuple[str, OffloadConfig | None]],
    layout: KVLayout,
    gpu_blocks: int,
) -> None:
    """Raise ValueError when a last turn cannot fit the GPU pool or a tier is too small.

    The reference engine gives every KV group its own blocks of the one pool, so a
    sequence needs its block count once per group.
    """
    tokens = workload.max_sequence_tokens
    block_size = layout.scheduler_block_size
    per_group = -(-tokens // block_size)
    needed = per_group * len(layout.groups)
    if needed > gpu_blocks - 1:  # block 0 is the null block
        groups = f" x {len(layout.groups)} KV groups" if len(layout.groups) > 1 else ""
        raise ValueError(
            f"a conversation's last turn holds {tokens} tokens ({per_group} blocks of"
            f" {block_size}{groups}), more than --gpu-blocks={gpu_blocks} can hold"
            f" ({gpu_blocks - 1} usable blocks): raise --gpu-blocks to at least {needed + 1},"
            " or use fewer --turns or shorter messages"
        )
    for name, config in configs:
        if config is None:
            continue
        for tier in config.tiers:
            try:
                config.num_tier_blocks(layout.bytes_per_block, tier)
            except ConfigError as exc:
                budget = "cpu_bytes" if tier is Tier.CPU else "disk_bytes"
                option = TIER_OPTIONS[(name, budget)]
                raise ValueError(f"{option} is too small for the {name} run: {exc}") from None
