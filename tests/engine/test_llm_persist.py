"""A persistent disk tier across engine restarts (SPEC §7 Beyond): hits again, or is discarded."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig
from kvtier.storage.manifest_format import HEADER

MIB = 1 << 20
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 120 for j in range(40)] for i in range(3)]


def persistent(tmp_path: Path, cascade: bool = False, token_check: bool = False) -> OffloadConfig:
    """A persistent disk tier (page cache: tmpfs may refuse O_DIRECT), maybe behind a CPU tier."""
    return OffloadConfig(
        cpu_bytes=MIB if cascade else 0,
        disk_bytes=4 * MIB,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        cascade=CascadeMode.WRITE_THROUGH,
        token_check=token_check,
    )


def run(offload: OffloadConfig | None, seed: int = 0) -> tuple[list[RequestOutput], int]:
    """Serve PROMPTS on a fresh engine; return outputs and the disk blocks it restored."""
    engine = EngineConfig(block_size=4, num_gpu_blocks=64, seed=seed)
    with LLM(ModelConfig.tiny(), kv_offload=offload, engine=engine) as llm:
        restored = 0 if llm.offload is None else llm.offload.num_restored_blocks
        return llm.generate(PROMPTS, PARAMS), restored


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.output_token_ids) for o in outputs]


@pytest.mark.parametrize("cascade", [False, True], ids=["disk", "cpu+disk"])
def test_a_restarted_engine_hits_the_disk_cache(tmp_path: Path, cascade: bool) -> None:
    reference, _ = run(None)
    first, restored = run(persistent(tmp_path, cascade))
    assert restored == 0
    assert sum(o.num_external_hit_tokens for o in first) == 0
    second, restored = run(persistent(tmp_path, cascade))
    assert restored > 0
    assert sum(o.num_external_hit_tokens for o in second) > 0, "the restart did not hit"
    assert tokens(second) == tokens(reference) == tokens(first)


@pytest.mark.parametrize("cascade", [False, True], ids=["disk", "cpu+disk"])
def test_token_tags_survive_a_restart(tmp_path: Path, cascade: bool) -> None:
    """With the token check on, the manifest keeps each slot's tag, so restored blocks
    are served after a restart; blocks a run without the check kept have no tag and
    are never served to a checking engine (a miss, not a risk)."""
    reference, _ = run(None)
    run(persistent(tmp_path, cascade, token_check=True))
    second, restored = run(persistent(tmp_path, cascade, token_check=True))
    assert restored > 0
    assert sum(o.num_external_hit_tokens for o in second) > 0, "restored tags did not match"
    assert tokens(second) == tokens(reference)

    untagged = tmp_path / "untagged"
    run(persistent(untagged, cascade))
    third, restored = run(persistent(untagged, cascade, token_check=True))
    assert restored > 0
    assert sum(o.num_external_hit_tokens for o in third) == 0
    assert tokens(third) == tokens(reference)


def test_a_prefix_kept_without_the_check_hits_again_from_the_second_checking_restart(
    tmp_path: Path,
) -> None:
    """A checking run stores its tagged copies of keys a run without the check kept; the
    manifest then holds both, and the next restarts serve the tagged ones.

    Regression: the untagged records (lower slots) were indexed first and the lookup
    checks a key's first block only, so every later run missed the whole prefix, demoted
    it again and its manifest grew by one more copy of every block (30, 60, 90 ...)."""
    reference, _ = run(None)
    run(persistent(tmp_path, cascade=True))
    restored_counts = []
    for _ in range(3):
        outputs, restored = run(persistent(tmp_path, cascade=True, token_check=True))
        assert tokens(outputs) == tokens(reference)
        restored_counts.append(restored)
        hits = sum(o.num_external_hit_tokens for o in outputs)
    assert hits > 0, "the tagged copies of the restarts before were not served"
    assert restored_counts[1] == restored_counts[2], "every restart stored the prefix again"


def test_another_model_discards_the_disk_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(persistent(tmp_path))
    reference, _ = run(None, seed=1)
    with caplog.at_level(logging.WARNING):
        other, restored = run(persistent(tmp_path), seed=1)  # other random weights
    assert restored == 0
    assert sum(o.num_external_hit_tokens for o in other) == 0
    assert "fingerprint changed (stored -> this engine): weights.random_seed: 0 -> 1" in (
        caplog.text
    )  # regression (review): the message showed two identical 80-character prefixes
    assert tokens(other) == tokens(reference)


@pytest.mark.parametrize("cut", ["whole slots", "mid-slot"])
def test_a_truncated_slot_file_keeps_the_whole_slots_below_the_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: str
) -> None:
    """A slot file cut short (an interrupted resize, a full disk) keeps the slots it still
    holds whole, and the tokens are those of an engine without offload."""
    reference, _ = run(None)
    run(persistent(tmp_path))
    (slot_file,) = tmp_path.glob("*.slots")
    with open(tmp_path / "kvtier-rank0.manifest", "rb") as manifest:
        _, _, num_slots, slot_bytes, _, _ = HEADER.unpack(manifest.read(HEADER.size))
    assert num_slots * slot_bytes == slot_file.stat().st_size
    kept_slots = 8
    os.truncate(slot_file, kept_slots * slot_bytes + (slot_bytes // 2 if cut == "mid-slot" else 0))
    with caplog.at_level(logging.WARNING):
        again, restored = run(persistent(tmp_path))
    assert 0 < restored <= kept_slots - 1  # slot 0 is the null block: never stored
    assert "keeping the slots both hold" in caplog.text
    assert tokens(again) == tokens(reference)
    assert slot_file.stat().st_size == num_slots * slot_bytes


def test_corrupted_slot_bytes_are_recomputed_not_served(tmp_path: Path) -> None:
    """Bytes changed behind the manifest's back fail their checksum: recompute, same tokens."""
    reference, _ = run(None)
    run(persistent(tmp_path))
    (slot_file,) = tmp_path.glob("*.slots")
    data = bytearray(slot_file.read_bytes())
    for i in range(0, len(data), 512):
        data[i] ^= 0xFF
    slot_file.write_bytes(bytes(data))
    again, restored = run(persistent(tmp_path))
    assert restored > 0
    assert sum(o.num_external_hit_tokens for o in again) == 0
    assert tokens(again) == tokens(reference)
