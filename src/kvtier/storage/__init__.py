"""The disk tier: the rank's slot file, direct or page-cache I/O, per-slot checksums."""

from kvtier.storage.disk_tier import DiskTier, DiskTierConfig, SlotRead, StagingBuffer
from kvtier.storage.slot_file import DiskIOError, DiskIOMode, FileIO, OsFileIO, SlotFile

__all__ = [
    "DiskIOError",
    "DiskIOMode",
    "DiskTier",
    "DiskTierConfig",
    "FileIO",
    "OsFileIO",
    "SlotFile",
    "SlotRead",
    "StagingBuffer",
]
