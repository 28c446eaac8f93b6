"""The manifest of a persistent disk tier: what each slot of the slot file holds, and its
recovery when the tier opens.

`kvtier-rank{N}.manifest` lives beside `kvtier-rank{N}.slots`. It is a header followed by
an append-only log of records. The byte layout and encoding are in `manifest_format`, the
open log that appends and compacts is `manifest_log`, the atomic rewrite is in
`manifest_compaction`, reading and replaying one in `manifest_read`; this module decides
at open whether to reuse (and resize) or discard it.

Rules. A slot's data is written and synced before its put record is appended (one sync
for a group of records: `pending_puts`), and every append is one `write` call on an
O_APPEND descriptor, not synced per record (see `disk_tier_records`). Replay applies records
in order, the last record of a slot wins; a record that fails its checksum (or is
otherwise invalid) is skipped with a warning and the replay resumes at the next valid
record, and a record cut short at the end is ignored (`manifest_read`: a skipped record
can only cause a miss). A record never makes a read return wrong bytes: reads are verified
against `data_sum`, so a stale record whose slot was rewritten since (its tombstone
skipped, or a manifest of a version that did not drop a reused slot's record before
overwriting it) fails verification instead. Tombstones keep a restart from offering a
slot that is known to be bad or overwritten.

At open (`open_manifest`) the manifest must be a regular file whose header matches the
identity exactly (the slot file's size aside); both must be owned by this
user and writable by no one else (files another user could have planted or rewritten
are never trusted, SPEC §7); otherwise both files are discarded and recreated (with a
warning naming the reason). Only the number of slots may differ (`disk_bytes` changed,
or an earlier resize was cut short): the tier keeps its live slots below both the new end
and the file's last whole slot, and the slot file is resized (`_resize`). A reused
manifest is compacted at once: the live records are written to a temporary file in the
same directory, fsynced, and renamed over it. When that rewrite fails (a full disk, an
I/O error), or the manifest cannot even be opened for lack of descriptors or memory, the
open fails with an OSError naming the file and the manifest is left as it was: the disk
tier needs its disk space to start, and a later open, once there is space, still
recovers the cache.

During a run the log compacts itself the same way, under the lock that serializes the
appends, right after an append that leaves it holding more than 4 records per live slot
and more than 4096 records (`manifest_compaction.compaction_due`); later records go to
the new file. The file at the manifest path is always a complete log, old or compacted,
so a crash at any point recovers a consistent state (a leftover `.tmp` is ignored and
removed by the next rewrite). A failed compaction is logged and the log keeps appending
to the old file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator

from kvtier.storage.file_lock import DiskTierBusyError, is_locked, unlink_quietly
from kvtier.storage.manifest_compaction import COMPACT_FLOOR
from kvtier.storage.manifest_format import (
    MANIFEST_VERSION,
    ManifestEntry,
    ManifestError,
    ManifestIdentity,
    check_record,
)
from kvtier.storage.manifest_log import ManifestLog
from kvtier.storage.manifest_read import read_manifest, read_manifest_any_size, trust_problem
from kvtier.storage.slot_file import SlotFile

__all__ = [
    "MANIFEST_VERSION",
    "SLOTS_SUFFIX",
    "ManifestEntry",
    "ManifestError",
    "ManifestIdentity",
    "ManifestLog",
    "check_manifest_paths",
    "check_no_persistent_tier",
    "check_record",
    "manifest_path_for",
    "open_manifest",
    "read_manifest",
    "remove_manifest",
]

logger = logging.getLogger(__name__)

SLOTS_SUFFIX = ".slots"


def manifest_path_for(slot_path: str) -> str:
    """Return the manifest path of the slot file `slot_path`: its name with `.slots`
    replaced by `.manifest` (`kvtier-rank0.slots` -> `kvtier-rank0.manifest`).

    Raises ValueError naming the path unless it ends in `.slots`. That keeps the mapping
    one to one (no two slot files share a manifest: with any name allowed, `x` and
    `x.slots` would) and keeps slot files apart from manifests and their `.tmp` files.
    """
    if not slot_path.endswith(SLOTS_SUFFIX):
        raise ValueError(
            f"a disk tier slot file's name must end in {SLOTS_SUFFIX!r} (its manifest is "
            f"the same name ending in '.manifest'), got {slot_path!r}"
        )
    return slot_path[: -len(SLOTS_SUFFIX)] + ".manifest"


def check_manifest_paths(slot_path: str) -> None:
    """Raise OSError naming the path when a directory is where the manifest of `slot_path`,
    or its temporary file, goes: the tier could neither write nor remove a file there.

    Any other object at those paths is handled where it is met: a manifest that is not a
    regular file is discarded (or, without persistence, removed) and a temporary file
    replaced. A symlink is never followed, so one to a directory is no directory here. A
    directory made there after this check is named the same way by the step it makes
    fail (`open_manifest`, `remove_manifest`).
    """
    error = _directory_error(slot_path)
    if error is not None:
        raise error


def _directory_error(slot_path: str) -> OSError | None:
    """Return the error naming a directory at the manifest paths of `slot_path`, if any."""
    manifest = manifest_path_for(slot_path)
    for path in (manifest, manifest + ".tmp"):
        try:
            is_directory = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:  # nothing there (or nothing to tell): the step's own error stands
            continue
        if is_directory:
            return OSError(  # EINVAL, as for a slot path that is not a regular file
                errno.EINVAL,
                "disk tier manifest path is a directory, not a regular file; remove it "
                "(the tier writes its manifest there) or give the disk tier another path",
                path,
            )
    return None


@contextlib.contextmanager
def _directories_named(slot_path: str) -> Iterator[None]:
    """Replace an OSError raised inside by the error of `check_manifest_paths` when a
    directory is now at the manifest paths of `slot_path`: one made there after that check
    fails the removal, write or rename of the manifest with a bare IsADirectoryError or
    FileExistsError that does not say what to do."""
    try:
        yield
    except OSError as exc:
        error = _directory_error(slot_path)
        if error is None:
            raise
        raise error from exc


def remove_manifest(slot_path: str) -> None:
    """Remove the manifest of `slot_path` if there is one (a non-persistent tier does, under
    its new slot file's lock: a manifest whose slot file was gone describes nothing, and
    no later persistent run may trust it), and a compaction's leftover `.tmp` with it;
    raise OSError naming the path on failure."""
    manifest = manifest_path_for(slot_path)
    with _directories_named(slot_path):
        unlink_quietly(manifest)
        unlink_quietly(manifest + ".tmp")


def check_no_persistent_tier(slot_path: str) -> None:
    """Raise unless a non-persistent tier may create its slot file at `slot_path`.

    DiskTierBusyError when a persistent tier there is in use by another process or
    worker; FileExistsError when a persistent tier's files are at rest there (starting
    without persistence would replace them).
    """
    manifest = manifest_path_for(slot_path)
    if not (os.path.exists(manifest) and os.path.lexists(slot_path)):
        return
    if is_locked(slot_path):
        raise DiskTierBusyError(
            errno.EBUSY,
            f"a persistent disk tier at this path (manifest {manifest}) is in use by "
            "another process or worker; do not remove its files, give this engine its own "
            "disk path (two engines must not share a disk tier directory for the same rank)",
            slot_path,
        )
    raise FileExistsError(
        errno.EEXIST,
        f"a persistent disk tier is at this path (manifest {manifest}); reuse it with "
        "disk_persist on (the reference engine; the vLLM connector does not persist), "
        "or remove both files, or give this engine another disk path",
        slot_path,
    )


def open_manifest(
    slot_file: SlotFile, identity: ManifestIdentity, compact_floor: int = COMPACT_FLOOR
) -> tuple[ManifestLog, dict[int, ManifestEntry]]:
    """Open the manifest of the persistent, locked `slot_file` and return it with the live
    slots it recovered.

    A reused slot file is kept when the manifest matches `identity` (its number of slots
    and the file's size may differ: the file is then resized, see `_resize`); otherwise
    both are discarded with a warning and the slot file is
    recreated. The manifest is then rewritten atomically with the live records only; an
    OSError naming the file (a full disk, an I/O error; a directory made at the manifest
    paths after `check_manifest_paths`: its error) leaves it as it was and is raised, with
    no manifest left open. `compact_floor` is the fewest records at which the log compacts
    itself during the run (see `compaction_due`).
    """
    with _directories_named(slot_file.path):
        return _open_manifest(slot_file, identity, compact_floor)


def _open_manifest(
    slot_file: SlotFile, identity: ManifestIdentity, compact_floor: int
) -> tuple[ManifestLog, dict[int, ManifestEntry]]:
    path = manifest_path_for(slot_file.path)
    live: dict[int, ManifestEntry] = {}
    resized_from = None
    if slot_file.reused:
        try:
            untrusted = trust_problem(slot_file.status(), "the slot file")
            if untrusted:
                raise ManifestError(untrusted)
            live, num_slots = read_manifest_any_size(path, identity)
            file_slots = slot_file.file_size() // identity.bytes_per_slot  # whole slots
            if file_slots * identity.bytes_per_slot != slot_file.file_size() or (
                file_slots != num_slots
            ):
                logger.warning(
                    "disk tier %s holds %d B, its manifest %s says %d slots of %d B (an "
                    "earlier resize was cut short, or the file was changed); keeping the "
                    "slots both hold",
                    slot_file.path,
                    slot_file.file_size(),
                    path,
                    num_slots,
                    identity.bytes_per_slot,
                )
                live = {slot: entry for slot, entry in live.items() if slot < file_slots}
        except ManifestError as exc:
            logger.warning(
                "discarding persistent disk tier %s (manifest %s): %s",
                slot_file.path,
                path,
                exc,
            )
            live = {}
            unlink_quietly(path)
            slot_file.recreate()
        else:
            if slot_file.file_size() != identity.num_slots * identity.bytes_per_slot:
                resized_from = file_slots
    # A shrink goes first (it frees the space the manifest's rewrite may need), a grow
    # last: see `_resize`.
    if resized_from is not None and resized_from > identity.num_slots:
        _resize(slot_file, resized_from, len(live))
    log = ManifestLog(path, identity.encode(), live, compact_floor)
    if resized_from is not None and resized_from <= identity.num_slots:
        try:
            _resize(slot_file, resized_from, len(live))
        except BaseException:
            log.close()
            raise
    return log, live


def _resize(slot_file: SlotFile, old_num_slots: int, num_kept: int) -> None:
    """Size a reused slot file that holds `old_num_slots` whole slots to the tier's
    number of slots (its live slots are the `num_kept` below both).

    Every open keeps only the live slots below the file's whole slots and the tier's
    number, so a shrink is safe before the manifest is rewritten and a grow after it: a
    crash between the two, or a grow that fails (the file is cut back to its size before;
    a filesystem may keep what it allocated), leaves files the next open, at any size,
    reuses the same way. Their bytes are as they were written; every read is checked
    against its record's checksum anyway.
    """
    old_size = slot_file.file_size()
    slot_file.resize()
    logger.warning(
        "disk tier %s resized from %d B (%d whole slots) to %d slots of %d B; kept %d cached "
        "blocks%s",
        slot_file.path,
        old_size,
        old_num_slots,
        slot_file.num_slots,
        slot_file.bytes_per_slot,
        num_kept,
        " (the slots past the new end are dropped)" if slot_file.num_slots < old_num_slots else "",
    )
