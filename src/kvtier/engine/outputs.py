"""What the reference engine returns per request (`RequestOutput`) and counts (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestOutput:
    """One finished request: its tokens, timing and where its prefix came from.

    `num_local_hit_tokens` / `num_external_hit_tokens`: the prompt tokens taken from
    the GPU cache / from kvtier's tiers (loaded) by the admission its first token came
    from; a later re-admission (after a preemption) does not count. `logits` holds, when
    `EngineConfig.keep_logits` is set, the float32 logits each output token was sampled
    from ([num_output_tokens, vocab_size]).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float
    tpot_s: float
    num_local_hit_tokens: int
    num_external_hit_tokens: int
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started; transfer totals are in `LLM.offload.totals`.

    Hit tokens are those of finished requests (`generate`'s and `step`'s alike), as
    each `RequestOutput` counts them.
    """

    num_steps: int = 0
    num_preemptions: int = 0
    # Steps in which a request short of GPU blocks waited for transfers to give some
    # back instead of preempting one (`Scheduler._frees_pending`).
    num_waits_for_frees: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_local_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
