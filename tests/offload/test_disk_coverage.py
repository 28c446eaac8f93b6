"""`DiskCoverage` (disk_coverage.py), the write-through stateful runs' check that the
disk holds every CPU block, against cascades broken on purpose and ones that are not.

Regression (the check excused real losses): it took a pair as given up whenever the
cascade's own retry table no longer held it after a failure, so a cascade that gave up
after one failure passed; it asked the cascade's own `_disk_copy` whether a copy was on
disk, so a cascade that took another tag's copy for its own passed; and a disk copy of
the key that went in the same step, before the pair existed, excused it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from disk_coverage import DiskCoverage
from test_cascade_demotions import WT, cache, key

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.offload.cascade import MAX_DEMOTION_ATTEMPTS, Cascade, MoveItem

TAG, OTHER = b"t" * 16, b"o" * 16


class GivesUpAtOnce(Cascade):
    """Forgets a failed demotion instead of retrying it."""

    def _note_failed_write_through(
        self, items: Sequence[MoveItem], retried: dict[tuple[int, Key], int]
    ) -> None:
        super()._note_failed_write_through(items, retried)
        for item in items:
            self.retry.pop((item.cpu_block_id, item.key), None)


class AnyTagWillDo(Cascade):
    """Takes a disk copy of the key for the CPU block's, whatever its token tag."""

    def _disk_copy(self, cpu_block_id: int, key: Key) -> int | None:
        return self.disk_pool.cached_block(key)


class NeverDemotes(Cascade):
    """Demotes nothing."""

    def _demote(self, cpu_block_ids: Iterable[int], counted: set[int] | None = None) -> None:
        pass


def pools() -> tuple[BlockPool, BlockPool]:
    return BlockPool(6), BlockPool(6)


def finish(cascade: Cascade, succeeded: bool = True) -> None:
    cascade.complete(cascade.take_queued(), succeeded=succeeded, abandoned=False)


def test_a_pair_forgotten_after_one_failure_is_missing() -> None:
    cpu, disk = pools()
    cascade = GivesUpAtOnce(cpu, disk, WT, reserve=2)
    coverage = DiskCoverage(cascade)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    finish(cascade, succeeded=False)
    assert not cascade.retry
    assert coverage.missing() == [(block, key(0))], "a retry forgotten was taken as given up"


def test_a_pair_given_up_after_every_attempt_failed_is_excused() -> None:
    cpu, disk = pools()
    cascade = Cascade(cpu, disk, WT, reserve=2)
    coverage = DiskCoverage(cascade)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    for _ in range(MAX_DEMOTION_ATTEMPTS):
        finish(cascade, succeeded=False)
        for _ in range(64):  # past the back-off
            cascade.select_retries()
            if cascade.queued:
                break
    assert not cascade.retry
    assert not cascade.queued
    assert coverage.missing() == []


def test_a_copy_with_another_tag_does_not_cover_a_tagged_block() -> None:
    cpu, disk = pools()
    cascade = AnyTagWillDo(cpu, disk, WT, reserve=2)
    (stale,) = disk.allocate(1)
    disk.insert_key(key(0), stale, 16, tag=OTHER)
    disk.free([stale])
    coverage = DiskCoverage(cascade)
    (block,) = cpu.allocate(1)
    cpu.insert_key(key(0), block, 16, tag=TAG)
    cpu.free([block])
    cascade.after_stores([block])
    assert cascade.take_queued() == []  # the broken cascade takes the stale copy for its own
    assert coverage.missing() == [(block, key(0))], "another tag's copy covered the block"
    cascade = Cascade(cpu, disk, WT, reserve=2)  # a sound one replaces the stale copy
    coverage = DiskCoverage(cascade)
    cascade.after_stores([block])
    finish(cascade)
    assert coverage.missing() == []


def test_a_copy_gone_before_the_block_was_handed_over_excuses_nothing() -> None:
    cpu, disk = pools()
    cascade = NeverDemotes(cpu, disk, WT, reserve=2)
    coverage = DiskCoverage(cascade)
    (old,) = cache(disk, [key(0)])
    disk.evict_keys(old)  # gone before the CPU tier registered the key
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    assert coverage.missing() == [(block, key(0))], "an earlier disk loss excused the block"


def test_a_never_handed_over_block_is_missing() -> None:
    cpu, disk = pools()
    coverage = DiskCoverage(Cascade(cpu, disk, WT, reserve=2))
    (block,) = cache(cpu, [key(0)])
    assert coverage.missing() == [(block, key(0))]


def test_copies_the_disk_lost_after_they_landed_are_excused() -> None:
    """Demoted, then evicted from disk; found on disk, then evicted by the very
    allocation that demotes the blocks after it: the cascade owes neither again."""
    cpu, disk = BlockPool(8), BlockPool(3)  # two disk slots
    cascade = Cascade(cpu, disk, WT, reserve=2)
    coverage = DiskCoverage(cascade)
    (a, b) = cache(cpu, [key(0), key(1)])
    cascade.after_stores([a, b])
    finish(cascade)
    assert coverage.missing() == []
    disk.evict_keys(disk.cached_block(key(1)))  # landed, then went
    assert coverage.missing() == []
    cascade.after_stores([b])  # stored again: owed again
    finish(cascade)
    cpu.discard_keys(a)  # key 0 goes to another CPU block; its disk copy stays
    (a2, c, d) = cache(cpu, [key(0), key(2), key(3)])
    cascade.after_stores([a2, c, d])  # key 0 is on disk; 2 and 3 take both disk slots
    finish(cascade)
    assert disk.cached_block(key(0)) is None
    assert disk.cached_block(key(1)) is None
    assert coverage.missing() == []
    cpu.check_invariants()
    disk.check_invariants()
