"""Bad inputs to the disk tier are refused at the call, naming the bad value, before
anything is queued: a record the manifest cannot hold, slot ids that are not a 1-D
integer array; and a write of no slots leaves no group behind.

Regressions (review): a record the manifest cannot hold was accepted by `write_slots`
and failed at the group's commit on the store I/O thread: the future of whichever write
committed raised a TypeError although its data was written, every other record of the
group was dropped (a restart missed slots written without fault), and a `close()` that
committed it raised. Slot ids of another dtype or shape passed the range check and
failed on the I/O thread with an IndexError or TypeError, after a persistent tier had
tombstoned the records of the slots their values truncate to. A write of no slots with
`records=[]` started the pending group's age, which `check_invariants` refuses.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np
import pytest

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig
from kvtier.storage.staging import StagingBuffer

SLOT = 4096

pytestmark = pytest.mark.timeout(60)


def config(tmp_path: Path, fingerprint: str | None = "fp") -> DiskTierConfig:
    return DiskTierConfig(
        os.path.join(tmp_path, "rank0.slots"),
        num_slots=8,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        batch_bytes=4 * SLOT,
        fingerprint=fingerprint,
    )


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def recovered_on_reopen(tmp_path: Path) -> list[int]:
    """Open the closed persistent tier at `tmp_path` again; return the slots it restores."""
    reopened = DiskTier(config(tmp_path))
    try:
        return [slot for slot, _ in reopened.recovered_slots()]
    finally:
        reopened.close()


def test_a_record_the_manifest_cannot_hold_is_refused_before_it_is_queued(
    tmp_path: Path,
) -> None:
    tier = DiskTier(config(tmp_path))
    buffer = tier.store_buffers[0]
    buffer.tensor[:2] = 7
    good = tier.write_slots(buffer, ids(0), [SlotRecord(b"k0", 16)])
    bad = SlotRecord("not bytes", 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not bytes"):
        tier.write_slots(tier.store_buffers[1], ids(1), [bad])
    good.result()
    tier.check_invariants()
    tier.close()  # never raises for the refused record
    reopened = DiskTier(config(tmp_path))
    try:
        assert reopened.recovered_slots() == [(0, SlotRecord(b"k0", 16))]
    finally:
        reopened.close()


def test_a_non_persistent_tier_ignores_the_records_it_is_given(tmp_path: Path) -> None:
    """Without a manifest the records are not written anywhere, so none is refused (the
    same job may go to either kind of tier). Mutant (s35 run on
    storage/disk_tier_records.py): records checked without a manifest passed every
    storage test."""
    tier = DiskTier(config(tmp_path, fingerprint=None))
    bad = SlotRecord(b"k" * 100_000, 16)  # longer than a manifest record holds
    tier.check_records([bad])
    tier.write_slots(tier.store_buffers[0], ids(0), [bad]).result()
    tier.check_invariants()
    tier.close()


@pytest.mark.parametrize(
    "slot_ids",
    [
        np.array([1.0, 2.0]),
        np.array([[1], [2]], dtype=np.int64),
        np.array([True, False]),
        [1, 2],
    ],
    ids=["float", "2-D", "bool", "list"],
)
@pytest.mark.parametrize("side", ["write", "read"])
def test_slot_ids_that_are_not_a_1d_integer_array_are_refused(
    tmp_path: Path, slot_ids: object, side: str
) -> None:
    tier = DiskTier(config(tmp_path))
    buffer = tier.store_buffers[0]
    buffer.tensor[:2] = 3
    tier.write_slots(buffer, ids(1, 2), [SlotRecord(b"a", 1), SlotRecord(b"b", 1)]).result()
    try:
        queue = (
            functools.partial(tier.write_slots, buffer)
            if side == "write"
            else functools.partial(tier.read_slots, tier.load_buffers[0])
        )
        with pytest.raises(ValueError, match="1-D integer array"):
            queue(slot_ids)
        tier.read_slots(tier.load_buffers[0], ids(1, 2)).result()  # nothing was touched
        tier.check_invariants()
    finally:
        tier.close()
    assert recovered_on_reopen(tmp_path) == [1, 2]


def test_a_write_of_no_slots_leaves_no_pending_group(tmp_path: Path) -> None:
    tier = DiskTier(config(tmp_path))
    try:
        tier.write_slots(tier.store_buffers[0], ids(), []).result()
        tier.check_invariants()
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("path", Path("/tmp/rank0.slots")),
        ("path", b"/tmp/rank0.slots"),
        ("fingerprint", b"fp"),
        ("fingerprint", 123),
        ("region_layout", None),
    ],
)
def test_config_fields_that_are_not_strings_are_refused_by_name(
    tmp_path: Path, field: str, value: object
) -> None:
    # Regression (review): accepted, then the open failed with an AttributeError naming
    # no field, after a persistent tier had created its slot file.
    fields: dict[str, object] = {"path": str(tmp_path / "rank0.slots"), "fingerprint": "fp"}
    fields[field] = value
    with pytest.raises(ValueError, match=f"{field} must be"):
        DiskTierConfig(num_slots=8, bytes_per_slot=SLOT, **fields)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [1.5, "1", True, np.float64(1.0)], ids=repr)
@pytest.mark.parametrize("call", ["forget", "prepare_overwrite"])
def test_slot_ids_to_forget_that_are_not_integers_are_refused(
    tmp_path: Path, bad: object, call: str
) -> None:
    # Regression (review): int() truncated 1.5 and parsed "1": slot 1's record was
    # dropped for a slot id naming no slot.
    tier = DiskTier(config(tmp_path))
    tier.write_slots(tier.store_buffers[0], ids(1), [SlotRecord(b"a", 1)]).result()
    with pytest.raises(ValueError, match=f"must be integers, got \\[{re.escape(repr(bad))}\\]"):
        getattr(tier, call)([bad])
    tier.forget([np.int64(3), 4])  # numpy integers are slot ids
    tier.close()
    assert recovered_on_reopen(tmp_path) == [1]


def test_a_persistent_tier_with_more_slots_than_a_record_holds_is_refused_by_value(
    tmp_path: Path,
) -> None:
    # Regression (review): manifest records hold slot ids as u32, but num_slots was
    # uncapped: a persistent tier of 2**32 + 1 slots opened, and the first write to slot
    # 2**32 failed its group's commit with a struct.error on the store I/O thread.
    path = str(tmp_path / "rank0.slots")
    with pytest.raises(ValueError, match="num_slots=4294967297"):
        DiskTierConfig(path, num_slots=2**32 + 1, bytes_per_slot=SLOT, fingerprint="fp")
    DiskTierConfig(path, num_slots=2**32, bytes_per_slot=SLOT, fingerprint="fp")
    DiskTierConfig(path, num_slots=2**32 + 1, bytes_per_slot=SLOT)  # no manifest: no cap
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("call", ["write_slots", "read_slots"])
@pytest.mark.parametrize("width", [SLOT // 2, SLOT])
def test_a_staging_buffer_not_of_the_tiers_slots_is_refused_by_size(
    tmp_path: Path, call: str, width: int
) -> None:
    # Regression (review): only the buffer's slot count was checked. A buffer of
    # 2048-byte rows read 2 slots as 4096 bytes: slot 1 came back a "checksum mismatch"
    # and its good record was tombstoned; written, slot 1 got no bytes but was marked
    # valid with the checksum of an empty slice. The same for a buffer of 4096-byte rows
    # whose flat `memory` holds fewer (mutation run, s30).
    tier = DiskTier(config(tmp_path))
    tier.store_buffers[0].tensor[:2] = 7
    records = [SlotRecord(b"a", 1), SlotRecord(b"b", 1)]
    tier.write_slots(tier.store_buffers[0], ids(0, 1), records).result()
    if width == SLOT:
        whole = tier.store_buffers[0] if call == "write_slots" else tier.load_buffers[0]
        buffer = StagingBuffer(whole.tensor, whole.memory[:SLOT])
    else:
        buffer = StagingBuffer.allocate(2, width)
    with pytest.raises(ValueError, match=f"{width}-byte rows, not the tier's {SLOT}"):
        getattr(tier, call)(buffer, ids(0, 1))
    tier.read_slots(tier.load_buffers[0], ids(0, 1)).result()  # nothing was touched
    tier.check_invariants()
    tier.close()
    assert recovered_on_reopen(tmp_path) == [0, 1]


@pytest.mark.parametrize("field", ["fingerprint", "region_layout"])
def test_config_text_the_manifest_cannot_encode_is_refused_by_name(
    tmp_path: Path, field: str
) -> None:
    # Regression (review): accepted, then the open failed with a bare UnicodeEncodeError
    # naming no field, leaving a persistent slot file without a manifest behind.
    fields = {"fingerprint": "fp", "region_layout": "k:4096", field: "k\ud800"}
    with pytest.raises(ValueError, match=f"{field} is not valid text"):
        DiskTierConfig(str(tmp_path / "rank0.slots"), 8, SLOT, **fields)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
