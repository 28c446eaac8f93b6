"""The data `EngineLoop` (`engine_loop`, for benchmarks) works with.

- `Request`: a request as the engine tracks it (tokens, block hashes and keys, its GPU
  block table); satisfies kvtier's `RequestView`.
- `EngineConfig`: the engine's scheduling limits and GPU pool size.
- `LoopTimes` / `LoopCounters`: nanoseconds per category (`KV_CALLS` for kvtier's calls)
  and what the loop did, cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_workload import RequestSpec
from kvtier.core.keys import BlockHash, Key, make_key
from kvtier.offload.protocols import LoRAInfo

GROUP_ID = 0

# ----------------------------------------------------------------------------- requests


class Request:
    """A request as the engine tracks it; satisfies kvtier's `RequestView`."""

    __slots__ = (
        "block_hashes",
        "block_keys",
        "blocks",
        "num_cached_blocks",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_prompt_tokens",
        "output",
        "request_id",
        "token_ids",
    )

    lora: LoRAInfo | None = None
    skip_prefix_cache: bool = False
    session_id: str | None = None

    def __init__(self, spec: RequestSpec) -> None:
        self.request_id = spec.request_id
        self.token_ids: list[int] = spec.prompt.tolist()
        self.num_prompt_tokens = len(self.token_ids)
        self.block_hashes: list[BlockHash] = list(spec.prompt_block_hashes)
        self.block_keys: list[Key] = [make_key(h, GROUP_ID) for h in self.block_hashes]
        self.output = spec.output
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.blocks: list[int] = []  # the GPU block table (one full-attention group)
        self.num_cached_blocks = 0  # leading blocks whose keys are in the GPU pool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        """Return no extra keys: the benchmark's requests carry none."""
        return ()

    def blocks_extra_keys(self, block_size: int, count: int) -> list[tuple[object, ...]]:
        """Return no extra keys, `count` times."""
        return [()] * count


# --------------------------------------------------------------- config and records


@dataclass(frozen=True)
class EngineConfig:
    """The engine's scheduling limits and GPU pool size."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int = 16
    waiting_depth: int = 8  # closed loop: requests kept waiting beyond max_num_seqs


KV_CALLS = (
    "lookup",
    "on_allocated",
    "step_input",
    "build_plan",
    "apply_report",
    "on_finished",
    "take_stats",
)


@dataclass(slots=True)
class LoopTimes:
    """Accumulated nanoseconds per category, and steps."""

    num_steps: int = 0
    engine_ns: int = 0
    worker_ns: int = 0
    frontend_ns: int = 0
    kvtier_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_CALLS, 0))

    @property
    def kvtier_total_ns(self) -> int:
        return sum(self.kvtier_ns.values())


@dataclass(slots=True)
class LoopCounters:
    """What the loop did (tokens, hits, tier traffic) — cumulative."""

    num_scheduled_tokens: int = 0
    num_local_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
    num_admitted: int = 0
    num_loads: int = 0
    num_finished: int = 0
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # prefill chunks cut short by the token budget
    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    store_outcomes: dict[str, int] = field(default_factory=dict)
