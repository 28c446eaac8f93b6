"""The scheduler role's connector stats: `SchedulerSide`'s base, which builds each
step's `KVTierStats` payload (stats.py describes it) from its offload scheduler's stats
and names its source among sibling kvtier connectors."""

from __future__ import annotations

import time
from typing import Any

from kvtier.adapters.vllm.stats import (
    GAUGES,
    KVTierStats,
    claim_source,
    info_section,
    is_sole_source,
    live_sources,
    release_source,
    stats_payload,
)
from kvtier.offload.scheduler import OffloadScheduler

# A connector with nothing new still sends its gauges this often: vLLM's log line shows
# only the payloads of its interval (VLLM_LOG_STATS_INTERVAL, 10 s by default), so an
# engine decoding without stores for a whole interval dropped out of it.
STATS_HEARTBEAT_S = 5.0
_clock = time.monotonic


class SchedulerStats:
    """Each step's stats payload of one scheduler role, and its stats source."""

    offload: OffloadScheduler

    def init_stats(self, engine: object, kv_cache_config: Any) -> None:
        """Claim this connector's stats source; `engine` is its data-parallel index.

        Its name in the stats: gauges of several kvtier connectors inside one
        MultiConnector, or of data-parallel engines (one process each, whose stats
        vLLM's aggregated log line merges), add up, each kept apart by source (`stats`):
        "E.N", the engine's data-parallel index and a number claimed in this process.
        Its siblings in one MultiConnector share vLLM's KV cache config (one object).
        """
        self._hit_tokens: dict[str, int] = {}  # cumulative per tier, at the last stats
        self._last_gauges: dict[str, int] | None = None
        self._source_number = claim_source(self)
        self.stats_source = f"{engine}.{self._source_number}"
        self._stats_group = kv_cache_config
        self._last_gauge_values: tuple[int, int, int] | None = None
        self._info: dict[str, str] | None = None  # the payloads' info labels, once built
        self._stats_sent_at = _clock()

    def take_stats(self) -> KVTierStats | None:
        """Return this step's stats, or None when nothing changed since the last ones
        and they were sent less than `STATS_HEARTBEAT_S` ago."""
        offload = self.offload
        gauges_now = offload.stats_gauges()
        now = _clock()
        due = now - self._stats_sent_at >= STATS_HEARTBEAT_S
        if not due and gauges_now == self._last_gauge_values and not offload.has_new_counts():
            return None  # the common decode step: skip building the payload
        self._last_gauge_values = gauges_now
        stats = offload.take_stats(gauges_now)
        new_hits = {
            tier: count - self._hit_tokens.get(tier, 0) for tier, count in stats.hit_tokens.items()
        }
        self._hit_tokens = dict(stats.hit_tokens)
        if self._info is None:  # fixed for the scheduler's life
            self._info = info_section(stats.info)
        payload = stats_payload(stats, new_hits, self.stats_source, self._info)
        gauges = payload[GAUGES][self.stats_source]
        if not due and not payload["counters"] and gauges == self._last_gauges:
            return None
        self._last_gauges = gauges
        self._stats_sent_at = now
        payload[GAUGES].update(self._sibling_gauges())
        return KVTierStats(data=payload)

    def _sibling_gauges(self) -> dict[str, dict[str, int]]:
        """Return the gauges each other kvtier connector of this engine (a sibling in
        one MultiConnector) last sent, by source.

        vLLM's log line sums only one interval's payloads (`KVConnectorLogging` starts
        each interval empty), and a connector with nothing new sends none: carried in
        every payload, its gauges stay in each interval's sum. A sibling's own newer
        payload of the same step comes later (MultiConnector asks its children in
        order) or was sent already, and its last gauges are its current ones.
        """
        if is_sole_source(self):  # the common deployment: one kvtier connector
            return {}
        return {
            owner.stats_source: dict(owner._last_gauges)
            for _, owner in live_sources()
            if isinstance(owner, SchedulerStats)
            and owner is not self
            and owner._stats_group is self._stats_group
            and owner._last_gauges is not None
        }

    def release_stats_source(self) -> None:
        """Free this connector's stats source number for a connector built later."""
        release_source(self._source_number, self)
