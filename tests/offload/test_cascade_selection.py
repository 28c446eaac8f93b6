"""How `Cascade` chooses demotions (`offload/cascade.py`): a retry in flight is not
waiting too, write-back leaves the disk copies of its victims and of CPU hits where
they are, a retry dropped for want of a disk slot keeps the attempts it spent, a block
whose keys a failed load discards is no longer given up nor retried, an eviction is
lost only with no copy of its key coming (nor one with its tag on disk), a reset ends the
back-off, write-through refreshes the disk copies a store did not load from, write-back
retries no dropped victim, and a demotion's disk event reuses the CPU event's payload."""

from __future__ import annotations

from dataclasses import replace

from test_cascade_demotions import WB, WT, cache, free_keys, key, make
from test_cascade_write_through_retries import fail_queued, retried_on_plans, retries_in_flight

from kvtier.core.block_pool import BlockPool
from kvtier.core.events import BlockStored
from kvtier.offload.cascade import MAX_DEMOTION_ATTEMPTS, Cascade


def test_a_block_reported_stored_while_its_retry_is_in_flight_is_not_waiting_too() -> None:
    """A retry in flight waits apart (`retrying`); the block reported stored again
    meanwhile finds its key in flight and is not added to the waiting retries as well
    (a mutant added it: a retry both waiting and running)."""
    cpu, _, cascade = make(WT)
    (block,) = cache(cpu, [key(0)])
    (item,) = retries_in_flight(cascade, [block])
    assert set(cascade.retrying) == {(block, key(0))}
    cascade.after_stores([block])
    assert cascade.take_queued() == []
    assert not cascade.retry.keys() & cascade.retrying.keys()
    cascade.complete([item], succeeded=True, abandoned=False)
    assert cascade.retry == {}
    assert cascade.retrying == {}


def test_write_back_leaves_the_disk_copy_of_a_victim_already_on_disk_in_place() -> None:
    """Write-back walks its next CPU victims every step; one already on disk is not
    demoted, and its disk copy is not refreshed either: the walk is no use of it (a
    mutant refreshed it, making key 0 the disk's most recently used)."""
    cpu, disk, cascade = make(WB)
    cache(disk, [key(0), key(1)])
    cache(cpu, [key(i) for i in (0, *range(10, 10 + cpu.num_usable_blocks - 1))])
    cascade.select_write_back()  # the next 2 victims: key 0 (on disk), key 10
    assert [item.key for item in cascade.take_queued()] == [key(10)]
    assert [k for k in free_keys(disk) if k is not None] == [key(0), key(1)]


def test_a_retry_dropped_for_want_of_a_disk_slot_keeps_its_spent_attempts() -> None:
    """A block that failed twice is reported stored again while every disk slot is
    pinned: its demotion is dropped with no attempt spent, and none given back either.
    In all it is written MAX_DEMOTION_ATTEMPTS times (a mutant reset its count to 0 on
    the drop: 5 failed writes, not 3)."""
    cpu, disk, cascade = make(WT)
    (block,) = cache(cpu, [key(0)])
    cascade.after_stores([block])
    num_failed = len(fail_queued(cascade))
    while cascade.retry.get((block, key(0))) != MAX_DEMOTION_ATTEMPTS - 1:
        cascade.select_retries()
        num_failed += len(fail_queued(cascade))
    cascade.set_aside.make_room(disk.num_usable_blocks)  # the failed slots back
    pinned = disk.allocate(disk.num_free())  # loads pin every disk slot
    cascade.after_stores([block])
    assert cascade.take_queued() == []
    assert cascade.retry == {(block, key(0)): MAX_DEMOTION_ATTEMPTS - 1}
    disk.free(pinned)
    for _ in range(80):
        cascade.select_retries()
        num_failed += len(fail_queued(cascade))
    assert num_failed == MAX_DEMOTION_ATTEMPTS
    assert cascade.retry == {}


def test_a_write_back_cpu_hit_leaves_the_disk_copy_in_place() -> None:
    """Only write-through keeps the disk's order in step with CPU hits (the disk holds
    what the CPU holds); write-back's disk holds CPU victims, and a CPU hit is no use of
    their disk copies (a mutant refreshed key 0's: the disk's order became [1, 0])."""
    cpu, disk, cascade = make(WB)
    cache(disk, [key(0), key(1)])
    cpu_blocks = cache(cpu, [key(0)])
    cascade.after_cpu_loads(cpu_blocks)
    assert [k for k in free_keys(disk) if k is not None] == [key(0), key(1)]


def test_a_given_up_block_whose_keys_are_discarded_is_given_up_no_more() -> None:
    """A write-back demotion failed: the block is given up until a demotion succeeds.
    A failed load then discards its keys (`before_cpu_discard` first): the pair goes
    (a mutant kept it: a given-up pair outliving its block's key)."""
    cpu, _, cascade = make(WB)
    cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    cascade.select_write_back()
    items = cascade.take_queued()
    cascade.complete(items, succeeded=False, abandoned=False)
    assert cascade.failed == {(item.cpu_block_id, item.key) for item in items}
    block = items[0].cpu_block_id
    cascade.before_cpu_discard(block)
    cpu.discard_keys(block)
    assert cascade.failed == {(item.cpu_block_id, item.key) for item in items[1:]}


def test_a_retry_in_flight_whose_keys_are_discarded_waits_no_more() -> None:
    """A failed load discards the keys of a block whose retry is in flight: its copy
    registers nothing, and the retry is forgotten at once (a mutant kept it among the
    retries in flight: a retry outliving its block's key)."""
    cpu, _, cascade = make(WT)
    (block,) = cache(cpu, [key(0)])
    (item,) = retries_in_flight(cascade, [block])
    cascade.before_cpu_discard(block)
    cpu.discard_keys(block)
    assert cascade.retrying == {}
    cascade.complete([item], succeeded=True, abandoned=False)
    assert cascade.retry == {}


def test_an_evicted_copy_of_a_key_whose_demotion_is_in_flight_is_not_lost() -> None:
    """Two CPU blocks hold key 0; one's demotion is in flight when the other is evicted:
    the disk gets the key, so nothing is lost (a mutant counted a lost block)."""
    cpu, _, cascade = make(WT)
    moving, other = cache(cpu, [key(0), key(0)])
    cascade.after_stores([moving])
    (item,) = cascade.take_queued()
    cpu.allocate(cpu.num_free())  # evicts `other`, and the unhashed blocks
    assert cpu.key(other) is None
    assert cascade.take_counters().num_lost_blocks == 0
    cascade.complete([item], succeeded=True, abandoned=False)


def test_a_reset_ends_the_back_off() -> None:
    """Four failed reports in a row put the next retry 16 plans off; a reset forgets
    them, and the first failure after it waits 2 plans (a mutant kept the count: 32)."""
    cpu, _, cascade = make(WT)
    blocks = cache(cpu, [key(i) for i in range(5)])
    for block in blocks[:4]:
        cascade.after_stores([block])
        fail_queued(cascade)
    cascade.forget_all()  # a reset
    cascade.after_stores(blocks[4:])
    fail_queued(cascade)
    assert retried_on_plans(cascade, 40)[:1] == [1]


def test_write_through_refreshes_every_disk_copy_of_a_store_but_the_loaded_ones() -> None:
    """A write-through store of two blocks both on disk, the first loaded from its disk
    copy: the load counted that copy's use, the second's copy is refreshed all the same
    (a mutant refreshed neither once any block of the store was loaded: the disk's
    order stayed [0, 1, 2])."""
    cpu, disk, cascade = make(WT)
    cache(disk, [key(0), key(1), key(2)])
    cpu_blocks = cache(cpu, [key(0), key(1)])
    cascade.after_stores(cpu_blocks, loaded=[0])
    assert cascade.take_queued() == []
    assert [k for k in free_keys(disk) if k is not None] == [key(0), key(2), key(1)]


def test_write_back_issues_no_retry_of_a_dropped_victim_used_since() -> None:
    """Write-back demotes the CPU tier's next victims only: a victim dropped for want of
    a disk slot and hit since (in use, no victim any more) is not demoted once a disk
    slot frees; the next victim is (a mutant queued dropped write-back demotions as
    write-through retries: key 0, in use, was written too)."""
    cpu, disk, cascade = make(WB, reserve=1)
    blocks = cache(cpu, [key(i) for i in range(cpu.num_usable_blocks)])
    pinned = disk.allocate(disk.num_free())  # loads pin every disk slot
    cascade.select_write_back()
    assert cascade.take_queued() == []
    assert cascade.take_counters().num_dropped_demotions == 1
    cpu.touch(blocks[:1])  # a hit: key 0 is in use
    disk.free(pinned)
    cascade.select_write_back()
    cascade.select_retries()  # a plan calls both
    assert [item.key for item in cascade.take_queued()] == [key(1)]


def test_an_evicted_tagged_block_whose_disk_copy_has_another_tag_is_lost() -> None:
    """With the token check, a disk copy of the key with another tag serves none of the
    CPU copy's requests: the CPU copy evicted undemoted is a lost block (a mutant looked
    the key up on disk ignoring tags: nothing counted lost)."""
    cpu, disk, cascade = make(WB)
    disk_block = cache(disk, [key(0)])[0]
    disk.discard_keys(disk_block)
    disk.touch([disk_block])
    disk.insert_key(key(0), disk_block, 16, tag=b"o" * 16)
    disk.free([disk_block])
    (block,) = cpu.allocate(1)
    cpu.insert_key(key(0), block, 16, tag=b"t" * 16)
    cpu.free([block])
    cpu.allocate(cpu.num_free())  # evicts it, no demotion in flight
    assert cpu.key(block) is None
    assert cascade.take_counters().num_lost_blocks == 1


def test_a_demotion_s_disk_event_carries_the_cpu_event_s_payload() -> None:
    """Events on: a demoted key's disk `BlockStored` is its CPU event's, tokens and
    parent included, with the disk's medium (a mutant kept no CPU payloads when a
    cascade publishes events: the disk event was payload-free)."""
    cpu = BlockPool(9, record_events=True, medium="CPU")
    disk = BlockPool(9, record_events=True, medium="DISK")
    cascade = Cascade(
        cpu, disk, WT, 2, event=lambda k, n: BlockStored(k[0], 0, n or 16, medium="DISK")
    )
    (block,) = cpu.allocate(1)
    stored = BlockStored(
        key(0)[0], 0, 16, medium="CPU", parent_block_hash=b"p", token_ids=(1,) * 16
    )
    cpu.insert_key(key(0), block, 16, stored)
    cascade.after_stores([block])
    cascade.complete(cascade.take_queued(), succeeded=True, abandoned=False)
    (event,) = [e for e in disk.take_events() if isinstance(e, BlockStored)]
    assert event == replace(stored, medium="DISK")
