"""A simple time-to-first-token model: recompute what no tier holds, load what one does.

    TTFT = prefill tokens / prefill_tokens_per_s  +  sum over tiers of loaded bytes / link

GPU-tier hits cost nothing; a lower-tier hit costs its blocks' bytes over that tier's
link; loading and prefill do not overlap (a conservative estimate). Defaults describe a
Llama-3-8B-shaped model in bf16 on one current datacenter GPU: 32 layers x 8 KV heads x
128 dims x (K, V) x 2 bytes = 128 KiB of KV per token, 10 k prefill tokens/s, a host
link of 25 GB/s (PCIe 4.0 x16 in practice) and a local NVMe disk at 5 GB/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_LINK_GBPS = {"CPU": 25.0, "DISK": 5.0}


@dataclass(frozen=True)
class CostModel:
    """Parameters of the TTFT estimate (GB = 1e9 bytes)."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if not is_positive_finite(self.prefill_tokens_per_s):
            raise ValueError(
                "prefill_tokens_per_s must be a number > 0 and finite, got "
                f"{self.prefill_tokens_per_s!r}"
            )
        if not is_int(self.bytes_per_token) or self.bytes_per_token <= 0:
            raise ValueError(
                f"bytes_per_token must be an int > 0 (bytes), got {self.bytes_per_token!r}"
            )

    def prefill_s(self, num_tokens: int) -> float:
        """Return the seconds to recompute `num_tokens` prompt tokens."""
        return num_tokens / self.prefill_tokens_per_s

    @staticmethod
    def load_s(num_bytes: int, link_gbps: float) -> float:
        """Return the seconds to move `num_bytes` over a `link_gbps` GB/s link."""
        return num_bytes / (link_gbps * 1e9)


def is_int(value: object) -> bool:
    """Return True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_finite(value: object) -> bool:
    """Return True for an int or float (not a bool) above 0 and below infinity."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
