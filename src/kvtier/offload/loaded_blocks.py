"""The GPU blocks a landed load filled, kept until their first store (with a cascade).

A request served from a tier uses the copy it loads: the DISK lookup touches the disk
copy, a CPU load refreshes it (`Cascade.after_cpu_loads`). The block is then on the GPU
and the CPU tier may lack it, so some store copies it down (the promotion) and that
store's demotion finds the disk copy: refreshing it again would count the one use twice
(S3-FIFO would set its frequency bit, LFU-DA count 2).

Eager stores belong to a request's table, lazy stores (the walk over freed blocks) and
hand-offs to none the scheduler tracks, so the record is kept per GPU block: loader and
key from the load's landing until the block's first completed store, which is the
loader's use when no other request used the block since. Another request using the
block (its table, its hand-off) drops the entry: that request's store is its own use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import Key
from kvtier.core.pool_block import NULL_BLOCK_ID
from kvtier.offload.store_batch import StoreBatch


@dataclass(slots=True)
class LoadedBlocks:
    """GPU block -> (the request whose load filled it, the key the load copied)."""

    by_block: dict[int, tuple[str, Key]] = field(default_factory=dict)

    def note_loaded(
        self, request_id: str, gpu_block_ids: Sequence[int], keys: Sequence[Key | None]
    ) -> None:
        """Record that a load of `request_id` filled `gpu_block_ids` with `keys` (the
        tier copies' keys; a block whose copy lost its key is not recorded)."""
        for block_id, key in zip(gpu_block_ids, keys, strict=True):
            if key is not None:
                self.by_block[block_id] = (request_id, key)

    def note_in_use(self, request_id: str, block_ids_per_group: Iterable[Sequence[int]]) -> None:
        """Drop the entries of blocks `request_id` uses unless it loaded them: its own
        store of such a block is its use (a reallocated block is another request's too)."""
        by_block = self.by_block
        if not by_block:
            return
        for block_ids in block_ids_per_group:
            for block_id in block_ids:
                entry = by_block.get(block_id)
                if entry is not None and entry[0] != request_id:
                    del by_block[block_id]

    def take_stores(self, stores: StoreBatch) -> set[int]:
        """Consume the entries of completed `stores`' GPU blocks; return the indices of
        the stores that copied a block under the key its load recorded (`after_stores`
        skips their disk copies' refresh). A store under another key only drops the
        entry: the block holds other KV now."""
        by_block = self.by_block
        if not by_block:
            return set()
        loaded: set[int] = set()
        for i, (block_id, key) in enumerate(zip(stores.gpu_block_ids, stores.keys, strict=True)):
            entry = by_block.pop(block_id, None)
            if entry is not None and entry[1] == key:
                loaded.add(i)
        return loaded

    def clear(self) -> None:
        """Forget every entry (a reset: what the tiers served before is dropped)."""
        self.by_block.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError on an entry for the null block (no load fills it)."""
        assert NULL_BLOCK_ID not in self.by_block, "a loaded entry for the null block"
