"""The disk tier: the rank's slot file, direct or page-cache I/O, per-slot checksums, and
the manifest of a persistent tier."""

from kvtier.storage.disk_tier import DiskTier, DiskTierConfig, SlotRead, StagingBuffer
from kvtier.storage.manifest import (
    ManifestEntry,
    ManifestError,
    ManifestIdentity,
    ManifestLog,
    manifest_path_for,
)
from kvtier.storage.slot_file import (
    DiskIOError,
    DiskIOMode,
    DiskTierBusyError,
    FileIO,
    OsFileIO,
    SlotFile,
)

__all__ = [
    "DiskIOError",
    "DiskIOMode",
    "DiskTier",
    "DiskTierBusyError",
    "DiskTierConfig",
    "FileIO",
    "ManifestEntry",
    "ManifestError",
    "ManifestIdentity",
    "ManifestLog",
    "OsFileIO",
    "SlotFile",
    "SlotRead",
    "StagingBuffer",
    "manifest_path_for",
]
