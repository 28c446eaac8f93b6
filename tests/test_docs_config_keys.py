"""README's `OffloadConfig` table names every key `OffloadConfig.from_dict` takes, and
no other (the vLLM settings: tests/adapters/test_vllm_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.offload.config import CONFIG_KEYS

README = Path(__file__).parents[1] / "README.md"


def test_the_offload_config_table_names_every_key() -> None:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Configuration (`OffloadConfig`)")
    lines = text[start : text.index("\n## ", start + 1)].splitlines()
    rows = [line.split("|")[1] for line in lines if line.startswith("| `")]
    keys = {key for row in rows for key in re.findall(r"`([a-z_]+)`", row)}
    assert keys == CONFIG_KEYS - {"disk_direct_io"}  # disk_io_mode's row names it
