"""Worker side of kvtier: KV region discovery, the host tier, batched copies, the worker."""

from kvtier.storage.slot_file import DiskIOMode
from kvtier.transfer.regions import Region, RegionSet, TensorLayout, discover_regions
from kvtier.transfer.worker import OffloadWorker, WorkerConfig, WorkerState

__all__ = [
    "DiskIOMode",
    "OffloadWorker",
    "Region",
    "RegionSet",
    "TensorLayout",
    "WorkerConfig",
    "WorkerState",
    "discover_regions",
]
