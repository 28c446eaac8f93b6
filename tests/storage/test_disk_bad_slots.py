"""A read that finds bad slots names every one of them and verifies the others."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOError, DiskIOMode, DiskTier, DiskTierConfig
from kvtier.storage.slot_checksums import bad_slots_error
from kvtier.storage.slot_file import BadSlotsError

SLOT = 8192

pytestmark = pytest.mark.timeout(60)


def test_a_read_names_every_bad_slot_of_its_batch(tmp_path: Path) -> None:
    """Two corrupted slots and a never-written one in one four-slot read: the error
    (a DiskIOError, message as before for the first) names all three; the good slot's
    bytes are in the buffer."""
    config = DiskTierConfig(
        os.path.join(tmp_path, "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        batch_bytes=4 * SLOT,
    )
    tier = DiskTier(config)
    gen = torch.Generator().manual_seed(31)
    out = tier.store_buffers[0]
    out.tensor[:3] = torch.randint(0, 256, (3, SLOT), dtype=torch.uint8, generator=gen)
    good = out.tensor[1].numpy().tobytes()
    tier.write_slots(out, np.array([4, 5, 6], dtype=np.int64)).result()
    with open(tier.path, "r+b") as raw:
        for slot in (4, 6):
            raw.seek(slot * SLOT + 9)
            value = raw.read(1)[0]
            raw.seek(slot * SLOT + 9)
            raw.write(bytes([value ^ 0x04]))
    buffer = tier.load_buffers[0]
    with pytest.raises(DiskIOError, match="checksum mismatch in slot 4") as caught:
        tier.read_slots(buffer, np.array([4, 5, 6, 9], dtype=np.int64)).result()
    assert isinstance(caught.value, BadSlotsError)
    assert caught.value.slots == (4, 6, 9)
    assert buffer.tensor[1].numpy().tobytes() == good
    tier.close()


def test_a_bad_slot_found_after_close_is_logged_as_kept_in_the_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read verified after `close()` finds a bad slot: the closed manifest cannot take
    its tombstone, so the record stays for the next run, which fails on it and drops it.
    Regression: the tier logged that it "dropped every record", though the manifest on
    disk still held them all."""
    config = DiskTierConfig(
        os.path.join(tmp_path, "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )
    tier = DiskTier(config)
    records = [SlotRecord(bytes([slot]) * 36, 4) for slot in (4, 5)]
    tier.write_slots(tier.store_buffers[0], np.array([4, 5], dtype=np.int64), records).result()
    with open(tier.path, "r+b") as raw:
        raw.seek(4 * SLOT + 9)
        value = raw.read(1)[0]
        raw.seek(4 * SLOT + 9)
        raw.write(bytes([value ^ 0x04]))
    read = tier.read_slots(tier.load_buffers[0], np.array([4, 5], dtype=np.int64))
    tier.close()
    with caplog.at_level(logging.INFO), pytest.raises(BadSlotsError):
        read.result()  # verified here, after the close
    assert "dropped every record" not in caplog.text
    assert (
        "1 slots failed their checksum after the tier closed: the manifest keeps their"
        " records, which the next run finds bad and drops"
    ) in caplog.text
    tier = DiskTier(config)
    assert [slot for slot, _ in tier.recovered_slots()] == [4, 5]
    tier.close()


@pytest.mark.parametrize(
    ("num_bad", "message"),
    [
        (1, "checksum mismatch in slot 2"),
        (2, "checksum mismatch in slot 2 (and 1 more bad slot in this read)"),
        (3, "checksum mismatch in slot 2 (and 2 more bad slots in this read)"),
    ],
)
def test_a_read_s_error_counts_the_other_bad_slots(num_bad: int, message: str) -> None:
    """The first bad slot's problem, then how many more (none said for one alone)."""
    problems = {slot: f"checksum mismatch in slot {slot}" for slot in range(2, 2 + num_bad)}
    error = bad_slots_error(problems, "/cache/rank0.slots")
    assert error.strerror == message
    assert error.slots == tuple(range(2, 2 + num_bad))
