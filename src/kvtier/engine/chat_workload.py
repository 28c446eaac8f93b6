"""A multi-turn chat workload: conversations sharing a system prompt, turns round-robin."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ChatWorkload:
    """Shape of the workload. Token counts are per message; ids are drawn from a seed.

    Every conversation starts with the shared system prompt, then a document of its own
    (an uploaded file or retrieved context), then alternating user and answer turns.
    """

    num_conversations: int = 8
    num_turns: int = 6
    num_system_tokens: int = 256
    num_document_tokens: int = 512
    num_user_tokens: int = 64
    num_answer_tokens: int = 16
    vocab_size: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, got {value!r}")
        for name in ("num_conversations", "num_turns", "num_answer_tokens", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        # A negative seed would draw the ids of its absolute value (`random.Random`).
        prompt_parts = ("num_system_tokens", "num_document_tokens", "num_user_tokens")
        for name in (*prompt_parts, "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not any(getattr(self, name) for name in prompt_parts):
            raise ValueError(f"{', '.join(prompt_parts)} are all 0: the first prompt is empty")

    @property
    def max_sequence_tokens(self) -> int:
        """Return the tokens of the longest sequence: a last turn's prompt and its answer."""
        per_turn = self.num_user_tokens + self.num_answer_tokens
        return self.num_system_tokens + self.num_document_tokens + self.num_turns * per_turn


@dataclass(frozen=True)
class TurnResult:
    """One conversation turn as served."""

    conversation: int
    turn: int
    num_prompt_tokens: int
    ttft_s: float
    output_token_ids: tuple[int, ...]
    num_local_hit_tokens: int
    num_external_hit_tokens: int

    @property
    def history_left_gpu(self) -> bool:
        """Return True for a later turn whose earlier history was not all on the GPU."""
        return self.turn > 0 and self.num_local_hit_tokens < self.num_prompt_tokens // 2


@dataclass(frozen=True)
class RunResult:
    """Everything one configuration produced."""

    name: str
    turns: tuple[TurnResult, ...]
    wall_s: float
    num_bytes_loaded: int
    num_bytes_stored: int
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Per direction (`GPU_to_CPU`, ...): bytes and copy seconds of completed transfers.
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)

    def ttfts(self, history_left_gpu: bool | None = None) -> list[float]:
        """Return TTFTs of all turns, or only of turns whose history did / did not leave."""
        return [
            t.ttft_s
            for t in self.turns
            if history_left_gpu is None or t.history_left_gpu == history_left_gpu
        ]

    @property
    def output_tokens(self) -> list[tuple[int, ...]]:
        """Return every turn's output tokens, in (conversation, turn) order."""
        return [
            t.output_token_ids for t in sorted(self.turns, key=lambda t: (t.conversation, t.turn))
        ]

    @property
    def tokens_per_s(self) -> float:
        """Return prompt + output tokens served per second of wall time."""
        total = sum(t.num_prompt_tokens + len(t.output_token_ids) for t in self.turns)
        return total / self.wall_s


def percentile(values: list[float], q: float) -> float:
    """Return the q-quantile (0..1) of `values` (0.0 when empty): linear between the
    sorted values, so 0 gives the least, 1 the largest and 0.5 the median."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if not values:
        return 0.0
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_chat(
    llm: LLM,
    workload: ChatWorkload,
    name: str,
    on_turn: Callable[[], None] | None = None,
    on_request: Callable[[], object] | None = None,
) -> RunResult:
    """Serve the workload on `llm`, one request at a time, conversations round-robin.

    Each user waits for the answer before the next turn, and the conversations take
    turns, so by a conversation's next turn the others have pushed its history out of
    a small GPU pool. TTFT is then the request's own prefill (or load) time.

    `on_request` is called after each answer, `on_turn` after each round of turns (a
    progress bar's updates); the time spent in them is left out of `wall_s`.
    """
    rng = random.Random(workload.seed)
    system = [rng.randrange(workload.vocab_size) for _ in range(workload.num_system_tokens)]
    histories = [
        system + [rng.randrange(workload.vocab_size) for _ in range(workload.num_document_tokens)]
        for _ in range(workload.num_conversations)
    ]
    params = SamplingParams(max_tokens=workload.num_answer_tokens, ignore_eos=True)
    turns = []
    in_callbacks = 0.0
    start = time.perf_counter()
    for turn in range(workload.num_turns):
        for conversation, history in enumerate(histories):
            user = [rng.randrange(workload.vocab_size) for _ in range(workload.num_user_tokens)]
            history.extend(user)
            (output,) = llm.generate([list(history)], params)
            history.extend(output.output_token_ids)
            turns.append(
                TurnResult(
                    conversation,
                    turn,
                    len(output.prompt_token_ids),
                    output.ttft_s,
                    output.output_token_ids,
                    output.num_local_hit_tokens,
                    output.num_external_hit_tokens,
                )
            )
            in_callbacks += _call(on_request)
        in_callbacks += _call(on_turn)
    llm.drain()
    wall = time.perf_counter() - start - in_callbacks
    offload = llm.offload
    return RunResult(
        name=name,
        turns=tuple(turns),
        wall_s=wall,
        num_bytes_loaded=0 if offload is None else offload.totals.num_bytes_loaded,
        num_bytes_stored=0 if offload is None else offload.totals.num_bytes_stored,
        hit_tokens_by_tier={} if offload is None else dict(offload.totals.hit_tokens),
        transfer_bytes={} if offload is None else dict(offload.totals.transfer_bytes),
        transfer_seconds={} if offload is None else dict(offload.totals.transfer_seconds),
    )


def _call(callback: Callable[[], object] | None) -> float:
    """Call `callback` (if any); return the seconds it took."""
    if callback is None:
        return 0.0
    start = time.perf_counter()
    callback()
    return time.perf_counter() - start
