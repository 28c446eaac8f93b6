"""A disk that starts with copies restored from a manifest, for the runs with a disk tier.

A restart indexes what a persistent disk kept (`OffloadScheduler.restore`). Here some
blocks of the two prefix families (`FAMILIES`, first group) start on disk, each copy
restored with one of three token tags when the token check is on:

- its own (what its tokens give): a hit served from disk from the first step;
- none (written by a run without the check): never served, the right bytes;
- `OTHER_TAG` (a hash collision's: another prefix with the same block hash): never
  served, and it holds that prefix's KV (`FOREIGN`), so serving it is wrong KV.

Write-through must not take the last two for the CPU copy's disk copy: it demotes the
tagged CPU copy, which replaces them (`Cascade._disk_copy`, `_register`); write-back and
disk-only runs must never serve them either. Without the check, tags are not kept and
every copy holds the right bytes.
"""

from __future__ import annotations

import random

from hypothesis import note
from scheduler_setup import FAMILIES, HASH_BLOCK
from sim import SimEngine, block_key, make_request

from kvtier.core.keys import Key
from kvtier.offload.plan import SlotRecord, Tier
from kvtier.offload.request_tags import RequestTags

OTHER_TAG = b"o" * 16  # no token sequence's tag (a collision's copy, as far as the run goes)
FOREIGN = "a colliding prefix's KV"  # the bytes of an OTHER_TAG copy
KINDS = ("own tag", "no tag", "other tag")


def restore_disk(engine: SimEngine, token_check: bool, rng: random.Random) -> set[Key]:
    """Restore up to one copy per disk slot of family blocks; return their keys.

    Call before the first lookup. Every worker holds each copy's bytes.
    """
    layout = engine.layout
    group = layout.groups[0]
    ratio = layout.blocks_per_hash(0)
    disk = engine.scheduler.index.pools[Tier.DISK]
    candidates: list[tuple[Key, bytes]] = []
    for f, family in enumerate(FAMILIES):
        request = make_request(f"family {f}", family, HASH_BLOCK)
        tags = RequestTags(layout).of(request)
        for pos in range(len(family) // group.block_size):
            candidates.append((block_key(layout, request, 0, pos), tags[(pos + 1) * ratio - 1]))
    num = rng.randint(1, min(len(candidates), disk.num_blocks - 1))
    records: list[tuple[int, SlotRecord]] = []
    for slot, (key, own) in enumerate(rng.sample(candidates, num), 1):
        kind = rng.choice(KINDS) if token_check else "no tag"
        tag = {"own tag": own, "no tag": None, "other tag": OTHER_TAG}[kind]
        note(f"restored on disk slot {slot}: {key} with {kind}")
        records.append((slot, SlotRecord(key, group.block_size, tag)))
        for space in engine.worker.lower["DISK"]:
            space[slot] = FOREIGN if tag == OTHER_TAG else key
    assert engine.scheduler.restore(Tier.DISK, records) == num
    return {record.key for _, record in records}
