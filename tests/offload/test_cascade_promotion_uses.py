"""Write-through: one request's use of a block is one use in the disk tier's policy.

A request served from disk loads the block (its lookup touches the disk copy: one use),
then stores it into the CPU tier (the promotion), and that store's demotion finds the
disk copy already there. The refresh it does for other stored blocks must not count a
second use of a copy the same request's load counted (regression: it did, so S3-FIFO set
the frequency bit of every promoted block and LFU-DA counted 2 for one use). Another
request storing the block again is another use (not one that hits it on the GPU after
the first request's compute failed: a hit writes nothing).
"""

from __future__ import annotations

from sim import SimEngine, keep_unwritten_keys, make_request
from test_scenarios_cascade import cascade_engine, holds, keys_of

from kvtier.core.keys import Key
from kvtier.core.policies.lfuda import LFUDAPolicy
from kvtier.core.policies.s3fifo import S3FIFOPolicy
from kvtier.offload.config import CascadeMode
from kvtier.offload.plan import Tier

A_KEYS = keys_of(range(12), 3)


def _served_from_disk(policy: str) -> SimEngine:
    """Store "a" (3 blocks, CPU + disk), evict it from the CPU tier and the GPU, and run
    "b" with the same prompt: a disk hit of 3 blocks, promoted into the CPU tier."""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, 4, 12, eviction_policy=policy)
    engine.run(make_request("a", range(12)))
    engine.drain()
    _evict_from_cpu(engine, 100)
    admission = engine.run(make_request("b", [*range(12), 7]))
    assert admission.num_accepted_tokens == 12
    engine.drain()
    assert all(holds(engine, Tier.CPU, key) for key in A_KEYS), "not promoted"
    assert engine.scheduler.loads.hit_tokens["DISK"] == 12
    return engine


def _evict_from_cpu(engine: SimEngine, first_token: int) -> None:
    engine.run(make_request(f"other{first_token}", range(first_token, first_token + 12)))
    engine.drain()
    assert not any(holds(engine, Tier.CPU, key) for key in A_KEYS)
    engine.evict_gpu()


def _disk_policy(engine: SimEngine) -> object:
    assert engine.scheduler.cascade is not None
    return engine.scheduler.cascade.disk_pool._free


def _disk_uses(engine: SimEngine, key: Key) -> int:
    """Return LFU-DA's count of accesses of `key` in the disk tier (store + uses)."""
    policy = _disk_policy(engine)
    assert isinstance(policy, LFUDAPolicy)
    return policy._sketch.estimate(key)


def test_a_promoted_block_counts_one_use_in_lfuda() -> None:
    engine = _served_from_disk("lfuda")
    assert [_disk_uses(engine, key) for key in A_KEYS] == [2, 2, 2]  # stored, then b
    engine.check()


def test_a_promoted_block_does_not_set_the_s3fifo_frequency_bit() -> None:
    engine = _served_from_disk("s3fifo")
    policy = _disk_policy(engine)
    assert isinstance(policy, S3FIFOPolicy)
    assert engine.scheduler.cascade is not None
    disk_pool = engine.scheduler.cascade.disk_pool
    blocks = [disk_pool.cached_block(key) for key in A_KEYS]
    # b's hit moved them from the probation FIFO to the main one; one hit, no bit.
    assert [policy._freq[b] for b in blocks if b is not None] == [0, 0, 0]
    engine.check()


def test_a_second_request_served_from_disk_is_a_second_use() -> None:
    engine = _served_from_disk("lfuda")
    _evict_from_cpu(engine, 200)
    admission = engine.run(make_request("c", [*range(12), 9]))
    assert admission.num_accepted_tokens == 12
    engine.drain()
    assert engine.scheduler.loads.hit_tokens["DISK"] == 24
    assert [_disk_uses(engine, key) for key in A_KEYS] == [3, 3, 3]
    engine.check()


def test_a_hit_on_an_unconfirmed_finishs_blocks_stores_and_counts_nothing() -> None:
    """b loads a's blocks from disk and ends without storing them (its compute failed:
    the engine cannot vouch for its blocks, held as unconfirmed); c then hits them on the
    GPU. A hit reads a block and writes nothing, so c stores none of them and counts no
    use of their disk copies. (Before eager mode kept a hit's unconfirmed blocks held,
    c stored them, a use each: this test checked [3, 3, 3]. A priority victim's blocks
    served so are KV never written: tests/offload/test_same_step_victim_hits.py.)"""
    engine = cascade_engine(CascadeMode.WRITE_THROUGH, 4, 12, eviction_policy="lfuda")
    keep_unwritten_keys(engine)  # an engine that serves them (kvtier asks it not to)
    engine.run(make_request("a", range(12)))
    engine.drain()
    _evict_from_cpu(engine, 100)
    b = make_request("b", [*range(12), 7])
    assert engine.admit(b) is not None
    while "b" in engine.loading:
        engine.step()
    engine.finish("b", computed=False)  # no store of b's blocks
    engine.drain()
    assert not any(holds(engine, Tier.CPU, key) for key in A_KEYS)
    assert [_disk_uses(engine, key) for key in A_KEYS] == [2, 2, 2]
    admission = engine.run(make_request("c", [*range(12), 9]))
    assert admission.num_local_tokens == 12  # b's loaded blocks, cached on the GPU
    engine.drain()
    assert not any(holds(engine, Tier.CPU, key) for key in A_KEYS)
    assert [_disk_uses(engine, key) for key in A_KEYS] == [2, 2, 2]
    engine.check()
