"""Disk tier edges a mutation run found untested (s30)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_disk_tier_inputs import SLOT, config, ids

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskTier
from kvtier.storage.staging import StagingBuffer

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("call", ["write_slots", "read_slots"])
def test_a_staging_buffer_whose_memory_is_not_its_rows_is_refused(
    tmp_path: Path, call: str
) -> None:
    """A buffer whose flat `memory` is shorter than its `tensor` rows: written, slot 1
    would get no bytes yet be marked valid with the checksum of an empty slice; read, it
    would come back a checksum mismatch and lose its good record."""
    tier = DiskTier(config(tmp_path))
    tier.store_buffers[0].tensor[:2] = 7
    tier.write_slots(tier.store_buffers[0], ids(0, 1), [SlotRecord(b"a", 1)] * 2).result()
    whole = tier.store_buffers[0] if call == "write_slots" else tier.load_buffers[0]
    cut = StagingBuffer(whole.tensor, whole.memory[:SLOT])
    with pytest.raises(ValueError, match=f"not the tier's {SLOT}-byte slots"):
        getattr(tier, call)(cut, ids(0, 1))
    tier.read_slots(tier.load_buffers[0], ids(0, 1)).result()
    tier.check_invariants()
    tier.close()
    reopened = DiskTier(config(tmp_path))
    try:
        assert [slot for slot, _ in reopened.recovered_slots()] == [0, 1]
    finally:
        reopened.close()
