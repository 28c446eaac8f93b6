"""kvtier's offload statistics as vLLM connector stats and Prometheus metrics.

The payload (`KVTierStats.data`) is a plain dict that survives vLLM's IPC to the
front-end process:

    {"counters": {name: number},              summed by `aggregate` (per step, per interval)
     "gauges":   {source: {name: number}},    latest value per source wins
     "info":     {source: {label: str}}}      deployment facts (tier, mode, capacity)

A source is one kvtier connector (scheduler role), named `E.N`: its engine's
data-parallel index E (each engine is a process; vLLM's aggregated log line merges the
stats of all of them) and a small number N claimed in that process (`claim_source`).
Several kvtier connectors inside one vLLM
`MultiConnector` share a class name, by which vLLM keys its children's stats, so their
stats of one step meet in `aggregate`, the call that also merges a step's stats into an
older step's: it cannot tell a sibling's gauges (to add) from a newer step's (to take),
and a connector with nothing new sends no stats at all. So gauges stay apart by source,
each source's newest winning, and are summed where they are read (`reduce`, the
Prometheus gauges, which remember each source's newest values per engine). vLLM's log
line sums one interval's payloads only, so each payload also carries the gauges its
sibling kvtier connectors last sent (`SchedulerSide.take_stats`).

Counter names are `stored_blocks`, `loaded_blocks`, `failed_loads`, `failed_stores`,
`bytes_stored`, `bytes_loaded`, `hit_tokens`, the cascade's `demoted_blocks`,
`failed_demotions`, `dropped_demotions`, `promoted_blocks`, `lost_blocks`, the token
check's `tag_mismatches`, and the
labelled `store_outcome.<outcome>` / `handoff_outcome.<outcome>` (kvtier's
`StoreOutcome` values), `tier_hit_tokens.<tier>` (`CPU` / `DISK`), and
`transfer_bytes.<type>` / `transfer_seconds.<type>` (a float) per direction (`GPU_to_CPU`,
`CPU_to_GPU`, `GPU_to_DISK`, `DISK_to_GPU`, `CPU_to_DISK`, as vLLM labels transfers).
Bytes are per rank; under pipeline parallelism, per rank of the first stage: vLLM gives
the scheduler role only that stage's KV cache config, and the other stages' slot bytes
(their own layers' pages) are known exactly only on their workers.
Prometheus exposes them as `kvtier:<name>_total` (a labelled family as one metric with an
`outcome`, `tier` or `transfer_type` label), gauges as `kvtier:<name>`, and the info
labels on `kvtier:info` (value 1).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.offload.stats import OffloadStats

PREFIX = "kvtier:"
COUNTERS = "counters"
GAUGES = "gauges"
INFO = "info"
INFO_LABELS = (
    "tier",
    "store_mode",
    "num_tier_blocks",
    "disk_io_mode",
    "cascade",
    "num_disk_blocks",
)
# Byte counts come from the scheduler role's KV cache config: a first-stage rank's.
_RANK_NOTE = " (of the first stage under pipeline parallelism)"
# payload prefix -> (metric name, label name, documentation)
_LABELLED_COUNTERS = {
    "store_outcome": ("store_outcomes", "outcome", "store outcomes of kvtier's store selection"),
    "handoff_outcome": (
        "handoff_outcomes",
        "outcome",
        "handoff outcomes of kvtier's store selection",
    ),
    "transfer_bytes": (
        "transfer_bytes",
        "transfer_type",
        "bytes of completed transfers per direction (GPU_to_CPU, CPU_to_GPU, ...), per rank"
        + _RANK_NOTE,
    ),
    "transfer_seconds": (
        "transfer_seconds",
        "transfer_type",
        "copy time of completed transfers per direction (each event's slowest rank)",
    ),
    "tier_hit_tokens": (
        "tier_hit_tokens",
        "tier",
        "prompt tokens served from kvtier, by the tier that served them",
    ),
}
_PLAIN_COUNTERS = {
    "stored_blocks": "KV blocks copied down to the tier (store completed on every rank)",
    "loaded_blocks": "KV blocks loaded back from the tier into the GPU cache",
    "failed_loads": "loads that failed; their tokens were recomputed",
    "failed_stores": "store candidates whose copy failed; nothing was registered",
    "bytes_stored": "bytes copied down to the tier, per rank" + _RANK_NOTE,
    "bytes_loaded": "bytes loaded from the tier, per rank" + _RANK_NOTE,
    "hit_tokens": "prompt tokens served from the tier instead of recomputed",
    "demoted_blocks": "KV blocks copied from the CPU tier down to the disk tier (cascade)",
    "failed_demotions": "CPU to disk copies that failed; nothing was registered (cascade)",
    "dropped_demotions": (
        "CPU blocks chosen for demotion that found no free disk slot (cascade), once each"
    ),
    "promoted_blocks": "disk-held KV blocks stored into the CPU tier again (cascade)",
    "lost_blocks": "KV blocks evicted from the CPU tier with no disk copy (cascade)",
    "tag_mismatches": "tier blocks not served: the key matched, the token check did not",
}
_GAUGES = {
    "tier_blocks_in_use": "tier blocks pinned by transfers or lookups (capacity minus free)",
    "blocks_pending_store": "blocks queued or in flight towards a tier (a cascade's demotions too)",
    "disk_slots_held": "disk slots held aside after failed copies (0 without a disk tier)",
}


# Owners (scheduler roles) by source number, held weakly: a number whose owner was
# garbage-collected is free again. Several engines of one process may step in their own
# threads: claims and releases take `_CLAIMS`, and `live_sources` reads the dict by one
# C-level copy (no other thread runs meanwhile), so no thread iterates it while another
# changes it. Dead entries stay until a claim reuses their number (a callback deleting
# them could run inside a claim, in any thread).
_SOURCES: dict[int, weakref.ref[object]] = {}
_CLAIMS = threading.Lock()


def claim_source(owner: object) -> str:
    """Return the smallest source number no live owner holds, now held by `owner`.

    Numbers are reused, so a connector rebuilt in one process (an engine restarted)
    takes its predecessor's place in the gauges rather than adding a stale source.
    """
    with _CLAIMS:
        number = 0
        while (held := _SOURCES.get(number)) is not None and held() is not None:
            number += 1
        _SOURCES[number] = weakref.ref(owner)
    return str(number)


def release_source(source: str, owner: object) -> None:
    """Free a source number `owner` claimed (it shuts down); no-op if it holds none."""
    with _CLAIMS:
        held = _SOURCES.get(int(source))
        if held is not None and held() is owner:
            del _SOURCES[int(source)]


def is_sole_source(owner: object) -> bool:
    """Return True when `owner` holds the only source number claimed (it has no siblings)."""
    held = tuple(_SOURCES.values())  # one C-level copy: safe beside other threads
    return len(held) == 1 and held[0]() is owner


def live_sources() -> list[tuple[str, object]]:
    """Return (source, owner) of every live owner of a source number."""
    entries = _SOURCES.copy()  # one C-level copy: safe beside other threads
    live = ((number, held()) for number, held in entries.items())
    return [(str(number), owner) for number, owner in live if owner is not None]


def summed_gauges(gauges: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Return a payload's gauges (by source) summed over its sources."""
    totals: dict[str, float] = {}
    for values in gauges.values():
        for name, value in values.items():
            totals[name] = totals.get(name, 0) + value
    return totals


def stats_payload(
    stats: OffloadStats,
    new_hit_tokens: Mapping[str, int],
    source: str = "0",
    info: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return the payload of one step's `OffloadStats`, from connector `source`.

    `new_hit_tokens` are the hit tokens per tier since the last payload (`stats.hit_tokens`
    is cumulative). `info`: the info section's labels, if already built (`info_section`
    of the same `stats.info`); copied into the payload.
    """
    counters: dict[str, float] = {}
    for name, value in (
        ("stored_blocks", stats.num_stored_blocks),
        ("loaded_blocks", stats.num_loaded_blocks),
        ("failed_loads", stats.num_failed_loads),
        ("failed_stores", stats.num_failed_stores),
        ("bytes_stored", stats.num_bytes_stored),
        ("bytes_loaded", stats.num_bytes_loaded),
        ("hit_tokens", sum(new_hit_tokens.values())),
        ("demoted_blocks", stats.num_demoted_blocks),
        ("failed_demotions", stats.num_failed_demotions),
        ("dropped_demotions", stats.num_dropped_demotions),
        ("promoted_blocks", stats.num_promoted_blocks),
        ("lost_blocks", stats.num_lost_blocks),
        ("tag_mismatches", stats.num_tag_mismatches),
    ):
        if value:
            counters[name] = value
    labelled: tuple[tuple[str, Mapping[str, float]], ...] = (
        ("store_outcome.", stats.store_outcomes),
        ("handoff_outcome.", stats.handoff_outcomes),
        ("tier_hit_tokens.", new_hit_tokens),
        ("transfer_bytes.", stats.transfer_bytes),
        ("transfer_seconds.", stats.transfer_seconds),
    )
    for prefix, values in labelled:
        for label, count in values.items():
            if count:
                counters[prefix + label] = count
    gauges = {
        "tier_blocks_in_use": stats.num_tier_blocks_in_use,
        "blocks_pending_store": stats.num_blocks_pending_store,
        "disk_slots_held": stats.num_disk_slots_held,
    }
    return {
        COUNTERS: counters,
        GAUGES: {source: gauges},
        INFO: {source: info_section(stats.info) if info is None else dict(info)},
    }


def info_section(info: Mapping[str, str]) -> dict[str, str]:
    """Return a payload's info labels of `OffloadStats.info` (absent labels empty)."""
    return {label: str(info.get(label, "")) for label in INFO_LABELS}


@dataclass
class KVTierStats(KVConnectorStats):
    """kvtier's connector stats; `data` is the payload described in the module docstring."""

    def __post_init__(self) -> None:
        for section in (COUNTERS, GAUGES, INFO):
            self.data.setdefault(section, {})

    def reset(self) -> None:
        """Drop every value."""
        empty: dict[str, Any] = {COUNTERS: {}, GAUGES: {}, INFO: {}}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        """Add `other`'s counters to this one's; take its gauges and info per source (a
        source's are newer in `other`; another source's are kept apart)."""
        if not isinstance(other, KVTierStats):
            raise TypeError(f"cannot aggregate KVTierStats with {type(other).__name__}")
        counters = self.data[COUNTERS]
        for name, value in other.data[COUNTERS].items():
            counters[name] = counters.get(name, 0) + value
        for section in (GAUGES, INFO):
            mine = self.data[section]
            for source, values in other.data[section].items():
                mine[source] = {**mine.get(source, {}), **values}  # copied: `other` unchanged
        return self

    def reduce(self) -> dict[str, int | float]:
        """Return counters and gauges (summed over sources) flattened for vLLM's
        periodic log line."""
        return {**self.data[COUNTERS], **summed_gauges(self.data[GAUGES])}

    def is_empty(self) -> bool:
        """Return True when the payload holds nothing at all."""
        return not any(self.data[section] for section in (COUNTERS, GAUGES, INFO))


def unregister_kvtier_metrics(registry: CollectorRegistry = REGISTRY) -> None:
    """Remove every `kvtier:` collector from `registry`.

    vLLM rebuilds its Prometheus logger in one process (a second engine, an elastic
    scale-up) after removing only its own `vllm:` collectors; kvtier's must go too, or
    registering them again fails with a duplicated time series.
    """
    # prometheus_client has no public listing; vLLM's own clean-up reads the same map.
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            registry.unregister(collector)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Register kvtier's metrics under the `kvtier:` prefix and record payloads into them.

    Building it again in one process replaces the `kvtier:` metrics in the default
    registry (`unregister_kvtier_metrics`), as vLLM does for its own.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Mapping[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        unregister_kvtier_metrics()
        labels = list(self._labelnames)
        self._counters = {
            name: self._counter_cls(
                name=f"{PREFIX}{name}_total", documentation=doc, labelnames=labels
            )
            for name, doc in _PLAIN_COUNTERS.items()
        }
        self._labelled = {
            prefix: self._counter_cls(
                name=f"{PREFIX}{metric}_total", documentation=doc, labelnames=[*labels, label]
            )
            for prefix, (metric, label, doc) in _LABELLED_COUNTERS.items()
        }
        self._gauges = {
            name: self._gauge_cls(
                name=f"{PREFIX}{name}",
                documentation=doc,
                labelnames=labels,
                multiprocess_mode="mostrecent",
            )
            for name, doc in _GAUGES.items()
        }
        # Per engine, each source's newest gauges; each gauge shows their sum. A kvtier
        # payload carries every sibling that has sent stats (`SchedulerSide.take_stats`),
        # so this only keeps the last values of a source one leaves out: a sibling shut
        # down, or a payload built otherwise (test_vllm_stats_payload's).
        self._latest: dict[int, dict[str, dict[str, float]]] = {}
        self._info = self._gauge_cls(
            name=f"{PREFIX}info",
            documentation="kvtier deployment facts; the value is always 1",
            labelnames=[*labels, *INFO_LABELS],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one payload for engine `engine_idx`; unknown names raise KeyError."""
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, value in transfer_stats_data.get(COUNTERS, {}).items():
            prefix, dot, label = name.partition(".")
            if dot:
                self._labelled[prefix].labels(*engine, label).inc(value)
            else:
                self._counters[name].labels(*engine).inc(value)
        gauges = transfer_stats_data.get(GAUGES)
        if gauges:
            latest = self._latest.setdefault(engine_idx, {})
            for source, values in gauges.items():
                latest[source] = {**latest.get(source, {}), **values}
            for name, value in summed_gauges(latest).items():
                self._gauges[name].labels(*engine).set(value)
        for info in transfer_stats_data.get(INFO, {}).values():
            self._info.labels(*engine, *(info.get(label, "") for label in INFO_LABELS)).set(1)
