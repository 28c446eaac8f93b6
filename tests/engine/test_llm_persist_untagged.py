"""A disk-only persistent tier with the token check replaces the untagged copies an
earlier run without the check kept (SPEC §3 Beyond, §7 Beyond).

Regression: a key restored without a token tag is never served under the check, and a
later store of the same key was skipped as "already cached": the untagged copy stayed,
and every checking restart missed the prefix again (a cascade's demotion replaced it,
a disk-only tier's store did not).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import DiskIOMode, OffloadConfig

MIB = 1 << 20
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 120 for j in range(40)] for i in range(3)]


def disk_only(tmp_path: Path, token_check: bool) -> OffloadConfig:
    """A persistent disk-only tier (page cache: tmpfs may refuse O_DIRECT)."""
    return OffloadConfig(
        disk_bytes=4 * MIB,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        token_check=token_check,
    )


def run(offload: OffloadConfig | None) -> tuple[list[RequestOutput], int]:
    """Serve PROMPTS on a fresh engine; return outputs and the disk blocks it restored."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=64)
    with LLM(ModelConfig.tiny(), kv_offload=offload, engine=engine) as llm:
        restored = 0 if llm.offload is None else llm.offload.num_restored_blocks
        return llm.generate(PROMPTS, PARAMS), restored


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.output_token_ids) for o in outputs]


def test_a_checking_run_replaces_the_untagged_copies_a_run_without_the_check_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = run(None)
    run(disk_only(tmp_path, token_check=False))  # its records carry no token tag
    first, restored = run(disk_only(tmp_path, token_check=True))
    assert restored > 0
    assert sum(o.num_external_hit_tokens for o in first) == 0  # untagged: never served
    assert tokens(first) == tokens(reference)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        second, restored_again = run(disk_only(tmp_path, token_check=True))
    assert sum(o.num_external_hit_tokens for o in second) > 0, "the untagged copies stayed"
    assert tokens(second) == tokens(reference)
    assert restored_again == restored  # one copy per key: the tagged one replaced the other
    assert "carry no token tag" not in caplog.text, caplog.text
