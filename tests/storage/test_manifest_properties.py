"""Replaying a manifest cut or damaged anywhere after its last compaction recovers
exactly the slots its intact records describe (crash consistency of the persistent tier).

Appends are not synced one by one, so after a power loss any prefix of the records
appended since the last compaction (which is synced before it replaces the file) may be
on the disk, the last one possibly torn; a damaged byte costs only its record (replay
skips it and resumes at the next record; see `test_manifest_resync` for more damage).
Random puts and forgets drive a real `ManifestLog` whose floor makes it compact often; a
model tracks the state at the last compaction and the records appended since.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.offload.plan import SlotRecord
from kvtier.storage import DiskIOMode, ManifestIdentity, SlotFile
from kvtier.storage.manifest import ManifestEntry, open_manifest, read_manifest
from kvtier.storage.manifest_format import encode_put, encode_tombstone

NUM_SLOTS = 6
IDENTITY = ManifestIdentity("model-a|kv|sha256:0", NUM_SLOTS, 4096, "kv[0]:4096")
COMPACT_FLOOR = 4

slots = st.integers(0, NUM_SLOTS - 1)
puts = st.lists(
    st.tuples(slots, st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=40)),
    min_size=1,
    max_size=5,
)
forgets = st.lists(slots, min_size=1, max_size=5)
operations = st.lists(
    st.one_of(puts.map(lambda p: ("put", p)), forgets.map(lambda f: ("forget", f))), max_size=60
)


@dataclass
class Model:
    """The live slots now, at the last compaction, and the records appended since."""

    live: dict[int, ManifestEntry] = field(default_factory=dict)
    compacted: dict[int, ManifestEntry] = field(default_factory=dict)
    appended: list[tuple[bytes, int, ManifestEntry | None]] = field(default_factory=list)
    start: int = 0  # where the appended records begin in the file (set once it is written)

    def put(self, slot: int, entry: ManifestEntry) -> None:
        self.live[slot] = entry
        self.appended.append((encode_put(slot, entry), slot, entry))

    def forget(self, slots: list[int]) -> None:
        for slot in dict.fromkeys(slots):
            if slot in self.live:  # only a slot whose last record is a put gets a tombstone
                del self.live[slot]
                self.appended.append((encode_tombstone(slot), slot, None))

    def compact(self) -> None:
        self.compacted, self.appended = dict(self.live), []

    def offset(self, num_records: int) -> int:
        """Return where appended record `num_records` begins in the file."""
        return self.start + sum(len(record) for record, _, _ in self.appended[:num_records])

    def after(self, num_records: int, skip: int | None = None) -> dict[int, ManifestEntry]:
        """Return the live slots once the first `num_records` appended records apply
        (all but appended record `skip`)."""
        state = dict(self.compacted)
        for index, (_, slot, entry) in enumerate(self.appended[:num_records]):
            if index == skip:
                continue
            if entry is None:
                state.pop(slot, None)
            else:
                state[slot] = entry
        return state


def write_manifest(directory: Path, ops: list[tuple[str, list]]) -> tuple[Path, Model]:
    """Run `ops` through a real log; return its file and the model."""
    slot_file = SlotFile(
        str(directory / "kvtier-rank0.slots"),
        NUM_SLOTS,
        IDENTITY.bytes_per_slot,
        DiskIOMode.PAGE_CACHE,
        persistent=True,
    )
    log, _ = open_manifest(slot_file, IDENTITY, compact_floor=COMPACT_FLOOR)
    model = Model()
    for kind, args in ops:
        compactions = log.compactions
        if kind == "put":
            entries = [ManifestEntry(checksum, SlotRecord(key, 16)) for _, checksum, key in args]
            log.put(
                [s for s, _, _ in args], [e.checksum for e in entries], [e.record for e in entries]
            )
            for (slot, _, _), entry in zip(args, entries, strict=True):
                model.put(slot, entry)
        else:
            log.forget(args)
            model.forget(args)
        if log.compactions != compactions:
            model.compact()
    log.close()
    slot_file.close()
    path = directory / "kvtier-rank0.manifest"
    model.start = len(IDENTITY.encode()) + sum(
        len(encode_put(slot, model.compacted[slot])) for slot in model.compacted
    )
    assert path.stat().st_size == model.offset(len(model.appended))
    return path, model


def offset_inside(data: st.DataObject, model: Model, index: int, label: str) -> int:
    """Draw a byte of appended record `index`; return its offset in the file."""
    length = len(model.appended[index][0])
    return model.offset(index) + data.draw(st.integers(0, length - 1), label=label)


@settings(max_examples=scaled_examples(150), deadline=None)
@given(ops=operations, data=st.data())
def test_any_cut_after_the_last_compaction_recovers_the_records_before_it(
    ops: list[tuple[str, list]], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, model = write_manifest(Path(tmp), ops)
        assert read_manifest(str(path), IDENTITY) == model.live
        num_whole = data.draw(st.integers(0, len(model.appended)), label="whole records")
        cut = model.offset(num_whole)
        if num_whole < len(model.appended):  # part of the next record may have landed too
            cut = offset_inside(data, model, num_whole, "torn")
        with open(path, "r+b") as file:
            file.truncate(cut)
        assert read_manifest(str(path), IDENTITY) == model.after(num_whole)


@settings(max_examples=scaled_examples(150), deadline=None)
@given(ops=operations, data=st.data())
def test_a_damaged_byte_costs_only_its_record(
    ops: list[tuple[str, list]], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, model = write_manifest(Path(tmp), ops)
        if not model.appended:
            return
        damaged = data.draw(st.integers(0, len(model.appended) - 1), label="damaged record")
        offset = offset_inside(data, model, damaged, "byte")
        flip = data.draw(st.integers(1, 255), label="xor")
        raw = bytearray(path.read_bytes())
        raw[offset] ^= flip
        path.write_bytes(bytes(raw))
        assert read_manifest(str(path), IDENTITY) == model.after(len(model.appended), damaged)
