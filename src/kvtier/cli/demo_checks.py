"""What `kvtier demo` checks before serving: the model folder, and that everything fits
(the option ranges and output folders, checked before the engine is imported, are in
`demo_ranges`).

Each check raises ValueError with a message naming the option to change, so a bad value
stops the demo at once with that message instead of a traceback minutes into a run.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from kvtier.cli.demo_ranges import check_model_dir_is_dir
from kvtier.core.kv_groups import KVLayout
from kvtier.core.plural import counted
from kvtier.engine.chat_workload import ChatWorkload
from kvtier.engine.config import ModelConfig
from kvtier.engine.weights import checkpoint_files
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig
from kvtier.offload.host import check_host
from kvtier.offload.plan import Tier
from kvtier.storage.slot_file import DIRECT_IO_ALIGNMENT

# The option that sizes each run's tier budget: (run name, config field) -> option.
TIER_OPTIONS = {
    ("CPU tier", "cpu_bytes"): "--cpu-mib",
    ("disk tier", "disk_bytes"): "--disk-mib",
    ("CPU+disk", "cpu_bytes"): "--cascade-cpu-mib",
    ("CPU+disk", "disk_bytes"): "--disk-mib",
}


def check_model_dir(model_dir: str) -> None:
    """Raise ValueError naming --model-dir when it holds no weights or a config we cannot read.

    Reads config.json and lists the safetensors files; the weights themselves are read
    (and checked against the config) when the engine loads them.
    """
    flag = f"--model-dir={model_dir}"
    path = Path(model_dir)
    check_model_dir_is_dir(model_dir)
    try:
        checkpoint_files(path)
        ModelConfig.from_hf_config(path)
    except KeyError as exc:
        raise ValueError(f"{flag}: config.json lacks the key {exc}") from None
    except (OSError, ValueError, TypeError) as exc:  # missing file, bad JSON, bad value
        raise ValueError(f"{flag}: {exc}") from None


def check_positions(workload: ChatWorkload, max_position: int) -> None:
    """Raise ValueError when a last turn holds more tokens than the model's positions.

    As vLLM with its `max_model_len`, the engine stops a request when it holds
    `max_position` tokens: a longer last turn would get a cut answer (and the runs would
    not serve the workload planned).
    """
    num_tokens = workload.max_sequence_tokens
    if num_tokens > max_position:
        raise ValueError(
            f"a conversation's last turn holds {num_tokens} tokens, more than the model's"
            f" max_position={max_position}: use fewer --turns or shorter messages"
        )


def check_sizes(
    workload: ChatWorkload,
    configs: list[tuple[str, OffloadConfig | None]],
    layout: KVLayout,
    gpu_blocks: int,
) -> None:
    """Raise ValueError when a last turn cannot fit the GPU pool, a tier is too small or
    too large for this machine, or direct disk I/O cannot write the blocks.

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
            f"a conversation's last turn holds {counted(tokens, 'token')} ("
            f"{counted(per_group, 'block')} of {block_size}{groups}), more than --gpu-blocks="
            f"{gpu_blocks} can hold ({counted(gpu_blocks - 1, 'usable block')}): raise"
            f" --gpu-blocks to at least {needed + 1}, or use fewer --turns or shorter messages"
        )
    for name, config in configs:
        if config is None:
            continue
        for tier in config.tiers:
            field = "cpu_bytes" if tier is Tier.CPU else "disk_bytes"
            option = f"{TIER_OPTIONS[(name, field)]}={getattr(config, field) >> 20}"  # MiB
            try:
                config.num_tier_blocks(layout.bytes_per_block, tier)
            except ConfigError as exc:
                raise ValueError(f"{option} is too small for the {name} run: {exc}") from None
            if tier is Tier.DISK:
                _check_free_space(config, f"{option} is too large for the {name} run")
                continue
            try:  # what `LLM` checks (prepare_host) when the run starts, minutes later
                check_host(config.cpu_bytes, 0, None)
            except ConfigError as exc:
                raise ValueError(f"{option} is too large for the {name} run: {exc}") from None

    _check_direct_io(configs, layout)


def _check_free_space(config: OffloadConfig, problem: str) -> None:
    """Raise ValueError, starting with `problem`, when the disk tier's file would not fit
    the free space.

    `prepare_host` compares `disk_bytes` with the filesystem's size, as a persistent
    tier's file may already take part of it. The demo's tier lives in a folder it has
    just made, so its whole file is new: without this check, sizing it fails with
    ENOSPC when that run starts, after the earlier runs were served. The message names
    the folder that folder was made in (--disk-dir, or the system's temporary folder):
    the demo's own is gone by the time the message is read.
    """
    assert config.disk_path is not None  # a disk tier's config names its folder
    place = Path(config.disk_path).parent
    usage = shutil.disk_usage(place)
    if config.disk_bytes > usage.free:
        raise ValueError(
            f"{problem}: the filesystem holding {place} has {usage.free >> 20} MiB free"
            f" ({usage.total >> 20} MiB in all); point --disk-dir at a folder on a larger"
            " filesystem, or use a smaller --disk-mib"
        )


def _check_direct_io(configs: list[tuple[str, OffloadConfig | None]], layout: KVLayout) -> None:
    """Raise ValueError when a disk run uses direct I/O with blocks it cannot write.

    O_DIRECT writes whole 4096-byte pages: a block (one disk tier slot) must be a
    multiple of DIRECT_IO_ALIGNMENT bytes.
    """
    bytes_per_block = layout.bytes_per_block
    is_direct = any(
        config is not None
        and Tier.DISK in config.tiers
        and config.disk_io_mode is DiskIOMode.DIRECT
        for _, config in configs
    )
    if not is_direct or bytes_per_block % DIRECT_IO_ALIGNMENT == 0:
        return
    block_size = layout.scheduler_block_size
    bytes_per_token = bytes_per_block // block_size
    aligned = DIRECT_IO_ALIGNMENT // math.gcd(DIRECT_IO_ALIGNMENT, bytes_per_token)
    raise ValueError(
        f"--disk-io=direct writes whole {DIRECT_IO_ALIGNMENT}-byte pages, but --block-size="
        f"{block_size} gives blocks of {bytes_per_block} bytes: use --disk-io page_cache, or a"
        f" --block-size that is a multiple of {aligned}"
    )
