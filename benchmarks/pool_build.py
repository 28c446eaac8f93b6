"""`bench_pool.py`'s pools: building one cached pool, churning it, measuring its memory.

`build_size` builds a pool with every usable block cached and free, in a random eviction
order, and measures its resident memory per cached block; then churns it until its index
dict resizes (its steady size under delete/insert churn). Two progress bars (stderr, a
terminal only) count the blocks built and churned; the build is timed chunk by chunk and
its bar moves between chunks, outside the timer.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
from collections.abc import Callable

import numpy as np

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key, make_key
from progress_bar import progress_bar

BUILD_CHUNK = 1 << 16
# Blocks evicted and re-cached at a time while churning: a step's worth, so the index's
# length stays near the pool size when it resizes (as in a running tier).
CHURN_BATCH = 256
NUM_TOKENS = 16


class KeyMaker:
    """Hands out distinct realistic 36-byte keys: a 32-byte digest + group id 0.

    The digests are random bytes (same size and randomness as sha256 output; hashing 10 M
    counters would add ~10 s to the build without changing what the pool stores).
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def take(self, count: int) -> list[Key]:
        """Return `count` new keys."""
        digests = self._rng.randbytes(32 * count)
        return [make_key(digests[i : i + 32], 0) for i in range(0, 32 * count, 32)]


def rss_bytes() -> int | None:
    """Return the resident set size of this process, or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def build_cached_pool(
    num_blocks: int, order: np.ndarray, keys: KeyMaker, on_blocks: Callable[[int], object]
) -> tuple[BlockPool, float]:
    """Return a pool with every usable block cached and free, evicted in `order`, and the
    seconds building it took: the sum of its chunks' times, so that `on_blocks(n)`, called
    after each chunk of n blocks cached and again after each chunk freed, stays out of it.
    """
    t0 = time.perf_counter()
    pool = BlockPool(num_blocks)
    num_usable = pool.num_usable_blocks
    seconds = time.perf_counter() - t0
    for start in range(0, num_usable, BUILD_CHUNK):
        t0 = time.perf_counter()
        taken = pool.allocate(min(BUILD_CHUNK, num_usable - start))
        for key, block_id in zip(keys.take(len(taken)), taken, strict=True):
            pool.insert_key(key, block_id, NUM_TOKENS)
        seconds += time.perf_counter() - t0
        on_blocks(len(taken))
    for start in range(0, num_usable, BUILD_CHUNK):
        t0 = time.perf_counter()
        pool.free(order[start : start + BUILD_CHUNK].tolist())
        seconds += time.perf_counter() - t0
        on_blocks(min(BUILD_CHUNK, num_usable - start))
    return pool, seconds


def memory_breakdown(pool: BlockPool) -> dict[str, float]:
    """Return `sys.getsizeof` bytes per cached block of each of the pool's structures."""
    # Private fields on purpose: this is a diagnostic of where the bytes go.
    index, queue = pool._index, pool._free
    arrays = (pool._refs, pool._num_tokens, queue._next, queue._prev)
    sizes = {
        "key_objects": sum(map(sys.getsizeof, filter(None, pool._keys))),
        "index_dict": sys.getsizeof(index),
        "index_int_values": sum(map(sys.getsizeof, index.values())),
        "keys_list": sys.getsizeof(pool._keys),
        "arrays": sum(map(sys.getsizeof, arrays)),
    }
    return {name: size / pool.num_usable_blocks for name, size in sizes.items()}


def churn_until_index_regrows(
    pool: BlockPool, keys: KeyMaker, on_blocks: Callable[[int], object]
) -> int:
    """Evict and re-cache blocks until the index dict resizes, calling `on_blocks(n)` after
    each n; return blocks churned.

    Deleted keys leave dummy slots, so a dict under delete/insert churn resizes to a
    table sized for 3 x its length and never shrinks back: that is its steady size.
    """
    index_bytes = sys.getsizeof(pool._index)  # private on purpose: the diagnostic
    num_churned = 0
    while sys.getsizeof(pool._index) == index_bytes and num_churned <= pool.num_usable_blocks:
        taken = pool.allocate(min(CHURN_BATCH, pool.num_usable_blocks))
        for key, block_id in zip(keys.take(len(taken)), taken, strict=True):
            pool.insert_key(key, block_id, NUM_TOKENS)
        pool.free(taken)
        num_churned += len(taken)
        on_blocks(len(taken))
    return num_churned


def build_size(
    num_blocks: int, rng: np.random.Generator, keys: KeyMaker, name: str
) -> tuple[BlockPool, dict]:
    """Build one cached pool, churn it to its steady size; return it with its memory numbers.

    Its bars, named after `name`, count each block twice as it is built (cached, then freed)
    and each block churned."""
    order = rng.permutation(num_blocks - 1) + 1
    with progress_bar(2 * len(order), unit="block", desc=f"build {name}") as bar:
        gc.collect()
        rss_before = rss_bytes()
        pool, build_s = build_cached_pool(num_blocks, order, keys, bar.update)
        gc.collect()
        rss_after = rss_bytes()
    num_cached = pool.num_usable_blocks
    assert pool.num_free() == num_cached
    built = memory_breakdown(pool)
    with progress_bar(None, unit="block", desc=f"churn {name}") as bar:
        num_churned = churn_until_index_regrows(pool, keys, bar.update)
    steady = memory_breakdown(pool)
    rss_built = rss_steady = None
    if rss_before is not None and rss_after is not None:
        rss_built = (rss_after - rss_before) / num_cached
        # The regrown table's pages become resident as its entries fill, before its next
        # resize: that is the most RSS the pool reaches in steady churn.
        rss_steady = rss_built + steady["index_dict"] - built["index_dict"]
    return pool, {
        "num_blocks": num_blocks,
        "build_s": build_s,
        "num_churned_blocks": num_churned,
        "rss_bytes_per_cached_block": rss_built,
        "steady_rss_bytes_per_cached_block": rss_steady,
        "getsizeof_bytes_per_cached_block": built,
        "getsizeof_total_per_cached_block": sum(built.values()),
        "steady_getsizeof_bytes_per_cached_block": steady,
        "steady_getsizeof_total_per_cached_block": sum(steady.values()),
    }
