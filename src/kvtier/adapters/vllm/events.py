"""kvtier's KV events translated into vLLM's KV event classes.

vLLM publishes them with the GPU pool's own events (one `KVEventBatch` per step), so
KV-aware routers see tier contents with the same schema. Differences handled here:
vLLM names the disk medium "STORAGE"; it takes a list of hashes per event (one here);
hashes go through vLLM's `maybe_convert_block_hash` (the low 64 bits as an int by
default, raw bytes when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); `kv_cache_spec_kind` is
vLLM's spec kind of the group (kvtier's group kinds are coarser), so it is given per group.

No vLLM import at module level: `EventTranslator` takes vLLM's event classes and hash
converter as values (`EventTranslator.for_vllm` supplies the real ones), so the
translation itself is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from kvtier.core.keys import BlockHash
from kvtier.offload.plan import Tier

LOCAL = "LOCAL"

_MEDIUM = {
    Tier.GPU.value: "GPU",
    Tier.CPU.value: "CPU",
    Tier.DISK.value: "STORAGE",
}


def vllm_medium(medium: str | None) -> str | None:
    """Return vLLM's medium name for a kvtier tier name ("DISK" is "STORAGE")."""
    return None if medium is None else _MEDIUM.get(medium, medium)


@dataclass(frozen=True)
class EventTranslator:
    """Build vLLM events from kvtier events.

    `block_stored` and `block_removed` are vLLM's event classes (called
    with keyword arguments); `convert_hash` is vLLM's `maybe_convert_block_hash`;
    `convert_extra_keys` is vLLM's `to_event_extra_keys` (its hash-time extra keys, one
    tuple per block, to the form events publish; by default they pass as they are);
    `group_spec_kinds[g]` is vLLM's `KVCacheSpecKind` value of group `g`, or None to
    fall back to kvtier's kind.
    """

    block_stored: Callable[..., Any]
    block_removed: Callable[..., Any]
    convert_hash: Callable[[BlockHash], Any]
    group_spec_kinds: tuple[str | None, ...] = ()
    convert_extra_keys: Callable[[list[tuple[Any, ...] | None]], Any] = list

    @staticmethod
    def for_vllm(kv_cache_config: Any) -> EventTranslator:
        """Return a translator to vLLM's own classes for the groups of `kv_cache_config`."""
        from vllm.distributed import kv_events
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        kinds = tuple(
            get_kv_cache_spec_kind(group.kv_cache_spec).value
            for group in kv_cache_config.kv_cache_groups
        )
        return EventTranslator(
            block_stored=kv_events.BlockStored,
            block_removed=kv_events.BlockRemoved,
            convert_hash=maybe_convert_block_hash,
            convert_extra_keys=to_event_extra_keys,
            group_spec_kinds=kinds,
        )

    def translate(self, event: KVEvent) -> Any:
        """Return the vLLM event for one kvtier event."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self.block_removed(
                block_hashes=[self.convert_hash(event.block_hash)],
                medium=vllm_medium(event.medium),
                group_idx=event.group_id,
                locality=LOCAL,
            )
        if isinstance(event, AllCleared):
            raise TypeError("AllCleared becomes several vLLM events: use translate_all")
        raise TypeError(f"not a kvtier KV event: {event!r}")

    def translate_all(self, events: Iterable[KVEvent]) -> list[Any]:
        """Return the vLLM events for `events`, in order.

        A tier reset (`AllCleared`) becomes one `BlockRemoved` per KV group naming every
        key the tier held, with the tier's medium: vLLM's `AllBlocksCleared` has no
        medium, so a router would read it as the GPU's prefix cache being cleared too.
        """
        out: list[Any] = []
        for event in events:
            if isinstance(event, AllCleared):
                out.extend(self._cleared(event))
            else:
                out.append(self.translate(event))
        return out

    def _cleared(self, event: AllCleared) -> list[Any]:
        by_group: dict[int, list[Any]] = {}
        for removed in event.removed:
            by_group.setdefault(removed.group_id, []).append(self.convert_hash(removed.block_hash))
        return [
            self.block_removed(
                block_hashes=hashes,
                medium=vllm_medium(event.medium),
                group_idx=group_id,
                locality=LOCAL,
            )
            for group_id, hashes in sorted(by_group.items())
        ]

    def _stored(self, event: BlockStored) -> Any:
        kinds: Sequence[str | None] = self.group_spec_kinds
        spec_kind = kinds[event.group_id] if event.group_id < len(kinds) else None
        parent = event.parent_block_hash
        return self.block_stored(
            block_hashes=[self.convert_hash(event.block_hash)],
            parent_block_hash=None if parent is None else self.convert_hash(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=vllm_medium(event.medium),
            lora_name=event.lora_name,
            extra_keys=self._extra_keys(event),
            group_idx=event.group_id,
            kv_cache_spec_kind=spec_kind if spec_kind is not None else event.group_kind,
            kv_cache_spec_sliding_window=event.sliding_window,
            locality=LOCAL,
            session_id=event.session_id,
        )

    def _extra_keys(self, event: BlockStored) -> Any:
        """Return the event's extra keys as vLLM publishes them: one entry per block.

        vLLM's GPU events say `[None]` for a block without extra keys. A payload-free
        event (lazy store, hand-off, cascade) whose extra keys are unknown (None: made
        without the request's block) says `None`, as vLLM says when it has no entries.
        """
        if event.extra_keys:
            return self.convert_extra_keys([tuple(event.extra_keys)])
        known = event.extra_keys is not None or event.token_ids
        return self.convert_extra_keys([None]) if known else None
