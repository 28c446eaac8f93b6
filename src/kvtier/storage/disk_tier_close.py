"""How a disk tier's files are closed (see `disk_tier`), by `DiskTier.close` or, for a tier
collected without it, by its finalizer: the pending records are committed, the slot file
is synced, then the manifest, and a failed sync removes the manifest instead of raising.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

from kvtier.storage.disk_io import IoThread
from kvtier.storage.disk_tier_records import DiskRecords
from kvtier.storage.file_lock import unlink_quietly
from kvtier.storage.manifest_compaction import sync_directory
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.slot_file import SlotFile

__all__ = ["close_dropped", "close_files"]

logger = logging.getLogger(__name__)


def close_files(file: SlotFile, log: ManifestLog | None) -> None:
    """Close a tier's files as `DiskTier.close` describes; the slot file (and its lock)
    last, so that the manifest is synced, or removed, while the lock is held. Safe to
    repeat (a closed file is left as it is); an interrupt (KeyboardInterrupt) is raised
    once both files are closed."""
    try:
        if log is not None:
            _sync_and_close_log(file, log)
    finally:
        file.close()


def close_dropped(io: Sequence[IoThread], file: SlotFile, records: DiskRecords) -> None:
    """Stop a tier's I/O threads (its queued I/O done: at interpreter exit there may be
    some), then commit the pending records and close the files of a tier collected
    without `close()`, as `close()` does, and warn. A record pends at collection after a
    write an interrupt withdrew, the queue not idle when the one before it ended."""
    for thread in io:
        thread.shutdown()
    records.commit()  # never raises
    close_files(file, records.log)
    warnings.warn(
        f"disk tier {file.path} was not closed; closed it at collection",
        ResourceWarning,
        stacklevel=2,
    )


def _sync_and_close_log(file: SlotFile, log: ManifestLog) -> None:
    failure: OSError | None = None
    interrupt: BaseException | None = None
    for step in (file.sync, log.close):
        try:
            step()
        except OSError as exc:
            failure = failure or exc
        except BaseException as exc:  # a Ctrl-C in the slot file's (long) sync: the
            interrupt = interrupt or exc  # manifest is still synced and closed, then it is raised
    if failure is not None:
        _remove_log(log, failure)
    if interrupt is not None:
        raise interrupt


def _remove_log(log: ManifestLog, failure: OSError) -> None:
    try:
        unlink_quietly(log.path)  # still under the slot file's lock
        sync_directory(log.path)  # or a crash may bring it back
    except OSError as exc:
        logger.error("%s; cannot remove the manifest either: %s", failure, exc)
        return  # its records stay checksummed: a bad slot fails to load, never served
    logger.error(
        "%s; removed the manifest %s: the next run of this persistent disk tier "
        "starts with an empty cache",
        failure,
        log.path,
    )
