"""Small traces for the replay tests (a chat workload and a document-reuse workload), and
the Python API's entries into a replay."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvtier.replay import ReplayConfig, TierConfig, TierReplay, replay_trace
from kvtier.replay.generate import ChatWorkloadConfig, generate_chat_trace
from kvtier.replay.sweep import run_sweep
from kvtier.replay.tier_replay import trace_keys
from kvtier.replay.trace import TraceRecord

BLOCK = 8  # tokens per block in the small traces


def chat_trace(seed: int = 0, conversations: int = 30) -> list[TraceRecord]:
    """Return a small multi-turn chat trace (8-token blocks, partial last blocks)."""
    config = ChatWorkloadConfig(
        seed=seed,
        num_conversations=conversations,
        arrival_rate_per_s=0.5,
        num_system_prompts=3,
        system_prompt_tokens=(16, 40),
        mean_turns=3.0,
        max_turns=6,
        user_tokens_median=10,
        answer_tokens_median=8,
        think_time_mean_s=20.0,
        block_size=BLOCK,
    )
    return generate_chat_trace(config)


def doc_trace(seed: int = 0, num_requests: int = 150) -> list[TraceRecord]:
    """Return requests that re-read one of a few documents (whole or a prefix) plus a suffix."""
    rng = random.Random(seed)
    next_id = 0
    docs: list[list[int]] = []
    records = []
    for i in range(num_requests):
        if docs and rng.random() < 0.6:
            doc = rng.choice(docs)
            prefix = doc[: rng.randint(1, len(doc))]
        else:
            prefix = []
        suffix = list(range(next_id, next_id + rng.randint(1, 6)))
        next_id += len(suffix)
        ids = prefix + suffix
        tokens = len(ids) * BLOCK - rng.randint(0, BLOCK - 1)
        if rng.random() < 0.3:  # re-read later, so whole blocks (a partial one has its own id)
            docs.append(ids)
            tokens = len(ids) * BLOCK
        records.append(TraceRecord(i * 10, tokens, rng.randint(1, 50), tuple(ids)))
    return records


API_CONFIG = ReplayConfig(tiers=(TierConfig("CPU", 10 * BLOCK, 25.0),), block_size=BLOCK)
"""One CPU tier of 10 blocks: what `API_ENTRIES` replay through."""


def _sweep(records: Sequence[TraceRecord]) -> object:
    return run_sweep(records, API_CONFIG, ["lru", "belady"], [10 * BLOCK])


API_ENTRIES: dict[str, Callable[[Sequence[TraceRecord]], object]] = {
    "replay_trace": lambda records: replay_trace(records, API_CONFIG),
    "TierReplay": lambda records: TierReplay(records, API_CONFIG),
    "run_sweep": _sweep,
    "trace_keys": lambda records: trace_keys(records, BLOCK),
}
"""The Python API's ways into a replay, by name: each checks the records handed to it."""
