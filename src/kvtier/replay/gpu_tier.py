"""The GPU tier of a replay: an LRU prefix cache in front of the lower tiers.

Nothing in it depends on the tiers behind, so it can be replayed alone: that pass tells
where each request's references start reaching the first lower tier (Belady's oracle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.core.block_pool import BlockPool
from kvtier.core.keys import Key
from kvtier.replay.belady import FutureOracle
from kvtier.replay.config import ReplayConfig, ReplayError
from kvtier.replay.trace import TraceRecord

ProgressFn = Callable[[int], None]


def request_tokens(records: Sequence[TraceRecord], block_size: int) -> list[list[int]]:
    """Return each request's tokens per block (a prompt's last block may be partial)."""
    bs = block_size
    return [[min(bs, r.input_length - j * bs) for j in range(len(r.hash_ids))] for r in records]


def make_gpu_pool(
    records: Sequence[TraceRecord], config: ReplayConfig, max_blocks: int
) -> BlockPool | None:
    """Return the replay's GPU pool (None without a GPU tier), at most `max_blocks` usable
    (more would never be used); raise `ReplayError` naming the largest request if the
    GPU tier cannot hold it."""
    if not config.gpu_capacity_tokens:
        return None
    num_gpu_blocks = config.gpu_capacity_tokens // config.block_size
    sizes = [len(record.hash_ids) for record in records]
    largest = max(range(len(sizes)), key=sizes.__getitem__, default=None)
    if largest is not None and sizes[largest] > num_gpu_blocks:
        raise ReplayError(
            f"request {largest} (0-based) needs {sizes[largest]} GPU blocks, the GPU "
            f"tier holds {num_gpu_blocks}; raise the GPU capacity to at least "
            f"{sizes[largest] * config.block_size} tokens"
        )
    return BlockPool(min(num_gpu_blocks, max(1, max_blocks)) + 1, medium="GPU")


def first_tier_oracle(
    records: Sequence[TraceRecord],
    config: ReplayConfig,
    keys: Sequence[Sequence[Key]],
    max_blocks: int,
    progress: ProgressFn | None = None,
    progress_every: int = 256,
) -> FutureOracle:
    """Return the first lower tier's oracle: the references the GPU tier does not serve.

    The GPU tier depends on nothing behind it, so one pass of it alone (reported to
    `progress`) serves every replay with the same GPU capacity, whatever its tiers.
    `max_blocks` caps the GPU pool (`max_blocks_held`: a larger one would never evict).
    """
    gpu = make_gpu_pool(records, config, max_blocks)
    if gpu is None:
        return FutureOracle(keys)
    starts = []
    for k, t in zip(keys, request_tokens(records, config.block_size), strict=True):
        starts.append(serve_on_gpu(gpu, k, t))
        if progress is not None and len(starts) % progress_every == 0:
            progress(progress_every)
    if progress is not None and len(starts) % progress_every:
        progress(len(starts) % progress_every)
    return FutureOracle(keys, starts, config.gpu_capacity_tokens)


def serve_on_gpu(pool: BlockPool, keys: Sequence[Key], tokens: Sequence[int]) -> int:
    """Run one request through the GPU tier; return its prefix hit in blocks.

    The hit blocks are touched, the missed ones allocated (evicting LRU; the pool fits
    the request: `make_gpu_pool`) and given their keys, then all are freed tail first.
    Nothing here depends on the lower tiers, so the GPU tier can be replayed alone.
    """
    hits = pool.lookup(keys)
    pool.touch(hits)
    new = pool.allocate(len(keys) - len(hits))
    first = len(hits)
    for j, block_id in enumerate(new):
        pool.insert_key(keys[first + j], block_id, tokens[first + j])
    table = hits + new
    table.reverse()
    pool.free(table)
    return first
