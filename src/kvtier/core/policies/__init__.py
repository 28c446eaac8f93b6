"""Tier policies, chosen by name: eviction order (a `FreeQueue`) and admission.

A policy name is `EVICTION` or `EVICTION+ADMISSION`, e.g. `lru`, `lfuda`, `lru+door`.

| name | kind | idea |
|---|---|---|
| `lru` | eviction | least recently freed first (the default) |
| `arc` | eviction | Adaptive Replacement Cache: recency vs frequency, tuned by ghost hits |
| `s3fifo` | eviction | small probation FIFO + main FIFO + ghost (SOSP '23) |
| `lfuda` | eviction | capped LFU with dynamic aging in F+1 LRU buckets (count-min sketch) |
| `duel` | eviction | LRU, or LFU-DA while sampled shadow caches show it hits significantly more |
| `door` | admission | store a block on its second sighting (aging Bloom filter) |

See docs/policies.md for costs and measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.policies.admission import DoorkeeperAdmission
from kvtier.core.policies.arc import ARCPolicy
from kvtier.core.policies.base import AdmissionPolicy, AdmitAll, EvictionPolicy, RequestObserver
from kvtier.core.policies.dueling import DuelingPolicy
from kvtier.core.policies.lfuda import LFUDAPolicy
from kvtier.core.policies.lru import LRUPolicy
from kvtier.core.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_POLICY",
    "EVICTION_POLICIES",
    "ARCPolicy",
    "AdmissionPolicy",
    "AdmitAll",
    "DoorkeeperAdmission",
    "DuelingPolicy",
    "EvictionPolicy",
    "LFUDAPolicy",
    "LRUPolicy",
    "PolicySpec",
    "RequestObserver",
    "S3FIFOPolicy",
]

EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "lfuda": LFUDAPolicy,
    "duel": DuelingPolicy,
}
ADMISSION_POLICIES: dict[str, Callable[[int], AdmissionPolicy]] = {
    "all": lambda num_blocks: AdmitAll(),
    "door": DoorkeeperAdmission,
}
DEFAULT_POLICY = "lru"


@dataclass(frozen=True)
class PolicySpec:
    """An eviction policy name and an admission policy name, e.g. parsed from `lru+door`."""

    eviction: str = DEFAULT_POLICY
    admission: str = "all"

    def __post_init__(self) -> None:
        for part, value in (("eviction", self.eviction), ("admission", self.admission)):
            if not isinstance(value, str):
                raise TypeError(f"{part} policy {value!r} is not a name (str)")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction!r}; "
                f"choose one of {', '.join(EVICTION_POLICIES)}"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"unknown admission policy {self.admission!r}; "
                f"choose one of {', '.join(ADMISSION_POLICIES)}"
            )

    @staticmethod
    def parse(name: str) -> PolicySpec:
        """Parse `EVICTION[+ADMISSION]`; raise ValueError naming a bad part."""
        if not isinstance(name, str):
            raise TypeError(f"policy {name!r} is not a name (str) like 'lru' or 'lru+door'")
        eviction, plus, admission = (part.strip() for part in name.lower().partition("+"))
        if plus and not admission:
            raise ValueError(f"policy {name!r}: missing admission policy after '+'")
        return PolicySpec(eviction, admission or "all")

    @property
    def name(self) -> str:
        """Return the canonical name (`lru`, `lru+door`)."""
        return self.eviction if self.admission == "all" else f"{self.eviction}+{self.admission}"

    def make_eviction(self, num_blocks: int) -> EvictionPolicy:
        """Return a fresh eviction policy for a pool of `num_blocks` blocks."""
        return EVICTION_POLICIES[self.eviction](num_blocks)

    def make_admission(self, num_blocks: int) -> AdmissionPolicy:
        """Return a fresh admission policy for a pool of `num_blocks` blocks."""
        return ADMISSION_POLICIES[self.admission](num_blocks)
