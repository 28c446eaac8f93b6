"""`DiskTier.forget`: copies the scheduler let go lose their manifest records, so a
restart does not restore them; when that cannot be recorded, every record goes."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from storage_helpers import WAIT_S, join_all, start_until_parked

from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, DiskTier, DiskTierConfig

SLOT = 4096

pytestmark = pytest.mark.timeout(60)


def rec(i: int) -> SlotRecord:
    return SlotRecord(i.to_bytes(4, "little") * 9, 4)


def tier_config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(
        str(tmp_path / "rank0.slots"),
        num_slots=16,
        bytes_per_slot=SLOT,
        io_mode=DiskIOMode.PAGE_CACHE,
        fingerprint="fp",
    )


def tier_with_four_records(config: DiskTierConfig) -> DiskTier:
    """Open the tier and write slots 1 to 4, each with its record (`rec`)."""
    tier = DiskTier(config)
    slots = np.arange(1, 5, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in range(1, 5)]).result()
    return tier


def test_a_disk_tier_that_cannot_drop_records_drops_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`DiskTier.forget` names copies the scheduler let go (maybe suspect): when their
    tombstones cannot be appended, the restart restores nothing rather than them."""
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    tier.forget([1])
    assert [slot for slot, _ in tier.recovered_slots()] == []  # this run wrote them all

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "no space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "write", full)
        tier.forget([2])
    assert "dropped every record" in caplog.text
    tier.forget([3])  # nothing left to drop
    with pytest.raises(ValueError, match="outside"):
        tier.forget([16])
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == []
    tier.close()


def test_a_disk_tier_restores_what_it_did_not_forget(tmp_path: Path) -> None:
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    tier.forget([1, 3])
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(2, rec(2)), (4, rec(4))]
    tier.forget([4])
    assert tier.recovered_slots() == [(2, rec(2))]
    tier.close()


def test_a_rewrite_whose_old_records_cannot_be_dropped_drops_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write without records (no record will describe its bytes) tombstones the slots'
    old records first; when that append fails, every record goes, as for `forget`: the
    old record of slot 2 would describe bytes it no longer holds."""
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    tier.close()
    tier = DiskTier(config)
    assert [slot for slot, _ in tier.recovered_slots()] == [1, 2, 3, 4]

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "no space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "write", full)  # the manifest's appends; slot data uses pwrite
        rewrite = np.array([2], dtype=np.int64)
        tier.write_slots(tier.store_buffers[0], rewrite, None).result()
    assert "dropped every record" in caplog.text
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == []
    tier.close()


def test_a_forget_whose_tombstones_cannot_be_synced_drops_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`forget`'s tombstones are synced before it returns (a crash must not bring back a
    copy the scheduler let go); when that fails, every record goes."""
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".manifest"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "fsync", failing_fsync)
        tier.forget([2])
    assert "cannot sync the manifest" in caplog.text
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == []
    tier.close()


def test_prepare_overwrite_drops_the_records_of_slots_about_to_be_written(
    tmp_path: Path,
) -> None:
    """A job's slots lose their records up front (one sync for the job); its batches then
    append the new ones. Out-of-range ids and a closed tier are refused."""
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    tier.close()
    tier = DiskTier(config)
    tier.prepare_overwrite([2, 3])
    assert [slot for slot, _ in tier.recovered_slots()] == [1, 4]
    tier.write_slots(tier.store_buffers[0], np.array([2], dtype=np.int64), [rec(7)]).result()
    with pytest.raises(ValueError, match="outside"):
        tier.prepare_overwrite([16])
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.prepare_overwrite([1])
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(1, rec(1)), (2, rec(7)), (4, rec(4))]
    tier.close()


def test_prepare_overwrite_whose_tombstones_cannot_be_appended_drops_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The job's slots keep their old records in the manifest when the tombstones fail:
    every record goes at once, as for `forget`, before the job writes a byte. Mutant
    (s35 run on storage/disk_tier_records.py): a failure ignored there passed every
    storage test (the recovered records of slots 1 and 4 were still offered)."""
    config = tier_config(tmp_path)
    tier = tier_with_four_records(config)
    tier.close()
    tier = DiskTier(config)

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "no space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(os, "write", full)  # the manifest's appends
        tier.prepare_overwrite([2, 3])
    assert "about to be rewritten" in caplog.text
    assert tier.recovered_slots() == []
    tier.close()
    tier = DiskTier(config)
    assert tier.recovered_slots() == []
    tier.close()


def test_a_closed_disk_tier_refuses_to_drop_records(tmp_path: Path) -> None:
    """`forget` and `end_persistence` after `close()` raise, naming the tier: the closed
    manifest keeps its records, so a quiet return would let a restart restore copies
    the caller believes dropped."""
    config = tier_config(tmp_path)
    tier = DiskTier(config)
    slots = np.arange(1, 3, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(1), rec(2)]).result()
    tier.close()
    with pytest.raises(RuntimeError, match=f"{config.path} is closed"):
        tier.forget([1])
    with pytest.raises(RuntimeError, match=f"{config.path} is closed"):
        tier.end_persistence()
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(1, rec(1)), (2, rec(2))]
    tier.close()


def test_a_close_waits_for_a_forget_already_running(tmp_path: Path) -> None:
    """A `forget` that passed the closed check when another thread began `close()`
    drops its records durably before the close syncs and closes the manifest.

    Regression: the close ran at once; the forget then reached a closed manifest and
    returned as if it had dropped the record, which a restart restored."""
    config = tier_config(tmp_path)
    tier = DiskTier(config)
    slots = np.arange(1, 4, dtype=np.int64)
    tier.write_slots(tier.store_buffers[0], slots, [rec(s) for s in range(1, 4)]).result()
    release = threading.Event()
    forget = tier._records.forget
    errors: list[BaseException] = []

    def held_forget(ids: list[int]) -> None:
        assert release.wait(WAIT_S), "the test never released the forget"
        forget(ids)

    def forget_slot_2() -> None:
        try:
            tier.forget([2])
        except BaseException as exc:
            errors.append(exc)

    tier._records.forget = held_forget  # type: ignore[method-assign]
    forgetting = start_until_parked(forget_slot_2, "forget")
    closing = start_until_parked(tier.close, "close")
    closing.join(0.5)  # time to finish, were it not waiting for the forget
    assert closing.is_alive(), "the close did not wait for the forget"
    release.set()
    join_all(forgetting, closing)
    assert errors == []
    tier = DiskTier(config)
    assert tier.recovered_slots() == [(1, rec(1)), (3, rec(3))]
    tier.close()
