"""The shape of one rank's disk tier (`DiskTierConfig`), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.storage.manifest import ManifestIdentity, manifest_path_for
from kvtier.storage.manifest_format import MAX_RECORD_SLOTS
from kvtier.storage.slot_file import DiskIOMode


@dataclass(frozen=True)
class DiskTierConfig:
    """Shape of one rank's disk tier. `path` is the slot file to create.

    `fingerprint` set makes the tier persistent: the slot file and its manifest are kept
    at close and reused at the next open when the fingerprint, `bytes_per_slot` and
    `region_layout` match (another `num_slots` resizes the file, keeping the slots that
    still fit). `path` must end in `.slots`
    (see `manifest_path_for`), persistent or not.
    """

    path: str
    num_slots: int
    bytes_per_slot: int
    io_mode: DiskIOMode = DiskIOMode.DIRECT
    num_buffers: int = 2  # staging buffers per direction; 2 = double buffering
    batch_bytes: int = 4 << 20  # bytes per staging buffer, rounded down to whole slots
    fingerprint: str | None = None  # None: a fresh file, removed at close
    region_layout: str = ""  # "name:bytes;..." per region; part of the persistent identity

    def __post_init__(self) -> None:
        for name in ("num_slots", "bytes_per_slot", "batch_bytes", "num_buffers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.io_mode, DiskIOMode):  # "direct" would silently be page cache
            raise ValueError(f"io_mode must be a DiskIOMode, got {self.io_mode!r}")
        for name in ("path", "region_layout"):  # a Path or bytes failed deep in the open
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.fingerprint is not None and (
            not isinstance(self.fingerprint, str) or not self.fingerprint
        ):
            raise ValueError(
                f"fingerprint must be None or a non-empty string, got {self.fingerprint!r}"
            )
        if self.fingerprint is not None and self.num_slots > MAX_RECORD_SLOTS:
            raise ValueError(
                f"num_slots={self.num_slots} is more than a persistent tier's manifest records"
                f" can name (slot ids are u32: at most {MAX_RECORD_SLOTS} slots)"
            )
        for name in ("fingerprint", "region_layout"):  # both go into the manifest's header
            text = getattr(self, name) or ""
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(f"{name} is not valid text: {text!r}") from exc
        manifest_path_for(self.path)  # raises ValueError unless it ends in ".slots"

    @property
    def identity(self) -> ManifestIdentity | None:
        """Return what a persistent tier's manifest must match, or None when not persistent."""
        if self.fingerprint is None:
            return None
        return ManifestIdentity(
            self.fingerprint, self.num_slots, self.bytes_per_slot, self.region_layout
        )

    @property
    def batch_slots(self) -> int:
        """Return the slots one staging buffer holds (at least one)."""
        return max(1, min(self.num_slots, self.batch_bytes // self.bytes_per_slot))
