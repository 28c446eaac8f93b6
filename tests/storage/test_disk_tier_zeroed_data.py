"""A manifest replayed over slot data that never reached the device (a crash on a
filesystem that journals metadata only): reopen must never serve the lost bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_disk_tier_forget import SLOT, rec, tier_config

from kvtier.storage import DiskTier
from kvtier.storage.slot_file import BadSlotsError

pytestmark = pytest.mark.timeout(60)


def test_reopen_never_serves_a_slot_zeroed_behind_the_manifest(tmp_path: Path) -> None:
    """The manifest's put record carries the slot's checksum: a zeroed slot fails its
    load (and loses its record), the untouched ones load their bytes."""
    config = tier_config(tmp_path)
    tier = DiskTier(config)
    slots = np.arange(1, 4, dtype=np.int64)
    buffer = tier.store_buffers[0]
    for i in range(3):
        buffer.memory[i * SLOT : (i + 1) * SLOT] = bytes([i + 7]) * SLOT
    tier.write_slots(buffer, slots, [rec(s) for s in range(1, 4)]).result()
    tier.close()
    with open(config.path, "r+b") as file:  # slot 2's data lost, its record kept
        file.seek(2 * SLOT)
        file.write(bytes(SLOT))
        os.fsync(file.fileno())
    tier = DiskTier(config)
    assert [slot for slot, _ in tier.recovered_slots()] == [1, 2, 3]
    out = tier.load_buffers[0]
    with pytest.raises(BadSlotsError, match="checksum mismatch in slot 2"):
        tier.read_slots(out, slots).result()
    good = np.array([1, 3], dtype=np.int64)
    tier.read_slots(out, good).result()
    assert bytes(out.memory[:SLOT]) == bytes([7]) * SLOT
    assert bytes(out.memory[SLOT : 2 * SLOT]) == bytes([9]) * SLOT
    tier.close()
    tier = DiskTier(config)  # the failed slot's record was dropped
    assert [slot for slot, _ in tier.recovered_slots()] == [1, 3]
    tier.close()
