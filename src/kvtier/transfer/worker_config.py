"""Configuration and lifecycle states of the offload worker."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from kvtier.offload.config import DiskIOMode
from kvtier.storage.manifest import manifest_path_for
from kvtier.storage.manifest_format import MAX_RECORD_SLOTS

MAX_IO_BYTES = 0x7FFFF000  # the most one read or write call moves on Linux (2 GiB - 4 KiB)


@dataclass(frozen=True)
class WorkerConfig:
    """Sizes of one rank's tiers, in slots (the scheduler side decides how many).

    A tier with 0 slots does not exist. `disk_path` is the directory that receives the
    rank's slot file `kvtier-rank{rank}.slots`.

    `disk_persist` keeps the slot file and its manifest `kvtier-rank{rank}.manifest` at
    shutdown and reuses them at the next `register` when `disk_fingerprint` (an opaque
    string from the engine: model, KV layout, hash algorithm and seed) and the worker's
    slot size and region layout match (another number of disk slots resizes the file,
    keeping the slots that still fit); otherwise they are discarded and recreated.
    """

    cpu_num_slots: int = 0
    disk_num_slots: int = 0
    disk_path: str | None = None
    disk_io_mode: DiskIOMode = DiskIOMode.DIRECT
    disk_buffer_slots: int = 2  # staging buffers per direction; 2 = double buffering
    disk_batch_bytes: int = 4 << 20  # bytes per staging buffer, rounded down to whole slots
    rank: int = 0
    # Threads each transfer lane splits its CPU block copies over (`copy_crew`), and the
    # OpenMP team of its thread's torch CPU ops. None: torch's intra-op thread count, at
    # most 4 (best bandwidth on a quiet machine). 1: one core per lane, which is steadier
    # on small or busy machines and leaves the engine's cores alone.
    copy_threads: int | None = None
    disk_persist: bool = False
    disk_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in (
            "cpu_num_slots",
            "disk_num_slots",
            "disk_buffer_slots",
            "disk_batch_bytes",
            "rank",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"WorkerConfig.{name} must be a non-negative int, got {value!r}")
        if self.disk_buffer_slots < 1 or self.disk_batch_bytes < 1:
            raise ValueError(
                "WorkerConfig.disk_buffer_slots and disk_batch_bytes must be "
                f"positive, got {self.disk_buffer_slots} and {self.disk_batch_bytes}"
            )
        if self.disk_batch_bytes > MAX_IO_BYTES:
            raise ValueError(
                f"WorkerConfig.disk_batch_bytes must be at most {MAX_IO_BYTES} (Linux moves "
                f"at most that much per read or write call), got {self.disk_batch_bytes}"
            )
        if self.disk_path is not None and not isinstance(self.disk_path, str):
            raise ValueError(f"WorkerConfig.disk_path must be a str, got {self.disk_path!r}")
        if self.copy_threads is not None and (
            not isinstance(self.copy_threads, int)
            or isinstance(self.copy_threads, bool)
            or self.copy_threads < 1
        ):
            raise ValueError(
                f"WorkerConfig.copy_threads must be None or a positive int, "
                f"got {self.copy_threads!r}"
            )
        if not isinstance(self.disk_io_mode, DiskIOMode):
            raise ValueError(
                f"WorkerConfig.disk_io_mode must be a DiskIOMode, got {self.disk_io_mode!r}"
            )
        if self.disk_num_slots and not self.disk_path:
            raise ValueError(f"WorkerConfig.disk_num_slots={self.disk_num_slots} needs a disk_path")
        self._check_persistence()

    def _check_persistence(self) -> None:
        if not isinstance(self.disk_persist, bool):
            raise ValueError(f"WorkerConfig.disk_persist must be a bool, got {self.disk_persist!r}")
        if not isinstance(self.disk_fingerprint, str):
            raise ValueError(
                f"WorkerConfig.disk_fingerprint must be a str, got {self.disk_fingerprint!r}"
            )
        if self.disk_persist and not self.disk_fingerprint:
            raise ValueError(
                "WorkerConfig.disk_persist=True needs a non-empty disk_fingerprint, "
                f"got disk_fingerprint={self.disk_fingerprint!r}"
            )
        if self.disk_persist and self.disk_num_slots > MAX_RECORD_SLOTS:
            raise ValueError(
                f"WorkerConfig.disk_num_slots={self.disk_num_slots} is more than a persistent"
                f" tier's manifest records can name (at most {MAX_RECORD_SLOTS} slots)"
            )
        try:
            self.disk_fingerprint.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"WorkerConfig.disk_fingerprint is not valid text: {self.disk_fingerprint!r}"
            ) from exc

    def disk_file(self) -> str:
        """Return the path of this rank's slot file."""
        if not self.disk_path:
            raise ValueError("WorkerConfig has no disk_path")
        return os.path.join(self.disk_path, f"kvtier-rank{self.rank}.slots")

    def disk_manifest_file(self) -> str:
        """Return the path of this rank's manifest (used when `disk_persist`)."""
        return manifest_path_for(self.disk_file())


class WorkerState(enum.Enum):
    """Lifecycle of an `OffloadWorker`."""

    CREATED = "created"
    REGISTERED = "registered"
    SHUTTING_DOWN = "shutting_down"  # shutdown() began and has not completed (retry it)
    SHUT_DOWN = "shut_down"
