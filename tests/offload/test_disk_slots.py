"""How `SetAsideSlots` sizes its trials (`offload/disk_slots.py`): a trial group passes
only once every slot of it was written, a bad slot found or a make-room give-back starts
the next suspects' trials afresh, and no group comes back while one is on trial.

Each test plays write jobs against a disk pool as the cascade does: a job allocates the
slots given back first, then fails (`note_failed`) or succeeds: its slots are cached
(freed to the tail) and `note_succeeded`.
"""

from __future__ import annotations

from test_cascade_demotions import key

from kvtier.core.block_pool import BlockPool
from kvtier.offload.disk_slots import SetAsideSlots


def succeed(disk: BlockPool, aside: SetAsideSlots, num_slots: int) -> list[int]:
    """Run a write job of `num_slots` slots that succeeds; return its slots."""
    job = disk.allocate(num_slots)
    for slot in job:
        disk.insert_key(key(1000 + slot), slot, 16)
    disk.free(job)
    aside.note_succeeded(job)
    aside.check_invariants()
    return job


def fail(disk: BlockPool, aside: SetAsideSlots, num_slots: int) -> list[int]:
    """Run a write job of `num_slots` slots that fails; return its slots."""
    job = disk.allocate(num_slots)
    aside.note_failed(job)
    aside.check_invariants()
    return job


def halved_to_one(disk: BlockPool, aside: SetAsideSlots) -> list[int]:
    """Leave two suspects whose trial failed together: trials of one slot next."""
    pair = fail(disk, aside, 2)
    aside.note_succeeded([])  # the disk works: both on trial
    assert fail(disk, aside, 2) == pair
    assert aside.trial_size == 1
    return pair


def test_a_bad_slot_found_gives_every_other_suspect_back_at_once() -> None:
    """Trials of one slot end at a bad slot: the other suspects need no more bisecting
    (a mutant kept trials of one, giving b back alone: on trial {b}, not {b, *fresh})."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    a, b = halved_to_one(disk, aside)
    aside.note_succeeded([])
    assert aside.on_trial == {a}
    assert fail(disk, aside, 1) == [a]
    assert aside.bad == [a]
    fresh = fail(disk, aside, 3)  # suspects now: b and 3 fresh slots
    aside.note_succeeded([])
    assert aside.on_trial == {b, *fresh}
    assert disk.num_free() == 16 - 1  # only the bad slot held


def test_a_trial_group_passes_only_once_all_its_slots_were_written() -> None:
    """The trial size doubles when a whole group passed, not at each job that wrote part
    of it (a mutant doubled at each: the group after [b, c] was 8 slots, not 4)."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    a, b = halved_to_one(disk, aside)
    fresh = fail(disk, aside, 8)
    aside.note_succeeded([])
    assert succeed(disk, aside, 1) == [a]  # passed: groups of 2
    assert aside.on_trial == {b, fresh[0]}
    assert succeed(disk, aside, 1) == [b]  # half the group written
    assert aside.trial_size == 2
    assert succeed(disk, aside, 1) == [fresh[0]]  # the whole group: groups of 4
    assert aside.on_trial == set(fresh[1:5])


def test_no_suspect_comes_back_while_a_trial_group_is_unwritten() -> None:
    """A job that wrote none of the trial slots proves nothing about them: the next
    group waits (a mutant gave it back too: on trial {a, b, c}, not {a})."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    a, _ = halved_to_one(disk, aside)
    fail(disk, aside, 1)  # a third suspect
    aside.note_succeeded([])
    assert aside.on_trial == {a}
    other = next(s for s in range(1, 17) if s != a and not disk.ref_count(s))
    aside.note_succeeded([other])  # a job that wrote another free slot
    aside.check_invariants()
    assert aside.on_trial == {a}


def test_slots_given_back_to_make_room_start_the_next_trials_afresh() -> None:
    """`make_room` gives every held slot back: the trials before it are over, and the
    next suspects come back all at once (a mutant kept trials of one: 2 came back)."""
    disk = BlockPool(6)
    aside = SetAsideSlots(disk)
    halved_to_one(disk, aside)
    aside.make_room(disk.num_free() + 1)
    assert len(aside) == 0
    assert len(aside.on_trial) == 2
    succeed(disk, aside, 2)  # both written: no trial left
    fresh = fail(disk, aside, 3)
    aside.note_succeeded([])
    assert aside.on_trial == set(fresh)


def test_bad_slots_come_back_too_when_the_disk_needs_room() -> None:
    """Only a bad slot is held, and a job needs more slots than are free: it comes back
    on trial with the rest (a mutant gave back suspects only: the disk ran out of room;
    another left it held as well as on trial)."""
    disk = BlockPool(6)
    aside = SetAsideSlots(disk)
    a, b = halved_to_one(disk, aside)
    aside.note_succeeded([])
    assert fail(disk, aside, 1) == [a]
    aside.note_succeeded([])
    assert succeed(disk, aside, 1) == [b]  # b passed: only the bad slot is held
    assert aside.held() == [a]
    aside.make_room(disk.num_free() + 1)
    aside.check_invariants()
    assert len(aside) == 0
    assert aside.on_trial == {a}
    assert disk.num_free() == 5


def test_a_reset_forgets_the_bad_slots_and_the_trials() -> None:
    """`clear` while a bad slot is held and a trial of one is pending: every slot is
    free, none on trial, and the next suspects come back all at once (mutants kept the
    bad slot held though freed, kept the trial pending, or kept trials of one)."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    a, b = halved_to_one(disk, aside)
    aside.note_succeeded([])
    assert fail(disk, aside, 1) == [a]  # bad
    group = fail(disk, aside, 2)
    aside.note_succeeded([])  # b and the 2 fresh suspects on trial
    assert set(fail(disk, aside, 3)) == {b, *group}  # failed together: trials of one
    aside.note_succeeded([])
    assert len(aside.on_trial) == 1
    aside.clear()
    aside.check_invariants()
    assert (len(aside), aside.on_trial, disk.num_free()) == (0, set(), 16)
    fresh = fail(disk, aside, 3)
    aside.note_succeeded([])
    assert aside.on_trial == set(fresh)


def test_a_failed_trial_group_of_three_is_tried_again_one_slot_first() -> None:
    """The trial size halves, rounded down (a mutant rounded up: 2 slots came back)."""
    disk = BlockPool(17)
    aside = SetAsideSlots(disk)
    fail(disk, aside, 3)
    aside.note_succeeded([])
    assert len(fail(disk, aside, 3)) == 3  # the three on trial, failed together
    assert aside.trial_size == 1
    aside.note_succeeded([])
    assert len(aside.on_trial) == 1


def test_every_suspect_comes_back_at_once_however_many() -> None:
    """Before any trial failed, the first group is every suspect (a mutant capped the
    first trial size at 64 slots)."""
    disk = BlockPool(81)
    aside = SetAsideSlots(disk)
    suspects = fail(disk, aside, 70)
    aside.note_succeeded([])
    assert aside.on_trial == set(suspects)
    assert len(aside) == 0
