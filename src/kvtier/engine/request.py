"""A generation request of the reference engine (it satisfies kvtier's `RequestView`)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.core.hashing import RequestHasher
from kvtier.core.keys import BlockHash
from kvtier.engine.sampling import FinishReason, Logprob, SamplingParams
from kvtier.offload.protocols import LoRAInfo


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting_for_load"  # its external tokens are being loaded
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One prompt and its generated tokens, with the engine's bookkeeping.

    Requests compare by identity (`eq=False`): the scheduler's queues find and remove a
    request with `in`/`remove`, and a copy with equal fields is another request.

    `num_computed_tokens` counts tokens whose KV is in the GPU cache (or is being loaded
    into it). `block_tables[g]` is the request's block table in KV group g; positions a
    sliding-window group no longer needs hold the null block. `kept_logits` holds, when
    `EngineConfig.keep_logits` is set, the float32 logits row each output token was
    sampled from (kept on the request, so they go when it goes). `generator` is the one
    `SamplingParams.make_generator` gave the engine for it (None when greedy).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hasher: RequestHasher
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_tables: list[list[int]] = field(default_factory=list)
    num_external_tokens: int = 0
    num_external_tokens_total: int = 0
    num_local_tokens_total: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    needs_full_table: bool = True
    # Scheduled work `complete` has not applied: a step cut short (Ctrl-C) before its
    # plan was built may have grown the tables unbeknownst to the offload side.
    has_unconfirmed_work: bool = False
    skip_external: bool = False  # a tier load failed: recompute instead
    kept_logits: list[torch.Tensor] = field(default_factory=list)
    session_id: str | None = None  # carried by the tier's stored-block events
    prompt: str | None = None  # a `TokensPrompt`'s text of its ids (not tokenized)
    # With `params.logprobs` set: per output token, its and the top tokens' `Logprob`s.
    sample_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # the sum of the sampled tokens' logprobs

    def __post_init__(self) -> None:
        self.hasher.extend(self.prompt_token_ids)

    # ------------------------------------------------------------ RequestView

    @property
    def num_tokens(self) -> int:
        """Return prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Return the prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_placeholders(self) -> int:
        """Return 0: the reference engine confirms every token in the step it is computed."""
        return 0

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Return the chained hashes of every full hash block so far."""
        return self.hasher.block_hashes

    @property
    def token_ids(self) -> Sequence[int]:
        """Return prompt plus output token ids."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lora(self) -> LoRAInfo | None:
        """Return None: the reference engine runs no LoRA adapters."""
        return None

    @property
    def skip_prefix_cache(self) -> bool:
        """Return False: the reference engine never asks for prompt logprobs."""
        return False

    def block_extra_keys(self, start: int, end: int) -> tuple[object, ...]:
        """Return the extra keys hashed into the block of tokens [start, end)."""
        return self.hasher.block_extra_keys(start, end)

    def blocks_extra_keys(self, block_size: int, count: int) -> list[tuple[object, ...]]:
        """Return `block_extra_keys` of the first `count` blocks of `block_size` tokens."""
        size = block_size
        return [self.block_extra_keys(i * size, (i + 1) * size) for i in range(count)]

    # ------------------------------------------------------------ engine side

    def append_output(self, token_id: int, now: float) -> None:
        """Record a generated token (its KV is computed in a later step)."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)
        self.hasher.extend([token_id])

    @property
    def ttft(self) -> float | None:
        """Return seconds from arrival to the first token, once there is one."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Return mean seconds per output token after the first, once finished."""
        if self.finish_time is None or self.first_token_time is None:
            return None
        if len(self.output_token_ids) < 2:
            return 0.0
        return (self.finish_time - self.first_token_time) / (len(self.output_token_ids) - 1)
