"""What the reference engine returns per request (`RequestOutput`, made by `output_of`) and
counts (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.request import Request


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
    # Running requests preempted (their blocks freed, they compute again).
    num_preemptions: int = 0
    # Waiting requests back from a load whose idle blocks were freed for a request that
    # could not run otherwise (not preemptions; `Scheduler._release_idle_blocks`).
    num_idle_releases: int = 0
    # Steps in which a request short of GPU blocks waited for transfers to give some
    # back instead of preempting one (`Scheduler._frees_pending`).
    num_waits_for_frees: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_local_hit_tokens: int = 0
    num_external_hit_tokens: int = 0


def output_of(request: Request) -> RequestOutput:
    """Return the `RequestOutput` of a finished request (its kept logits stacked)."""
    rows = request.kept_logits
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        output_token_ids=tuple(request.output_token_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else "",
        ttft_s=request.ttft or 0.0,
        tpot_s=request.tpot or 0.0,
        num_local_hit_tokens=request.num_local_tokens_total,
        num_external_hit_tokens=request.num_external_tokens_total,
        logits=torch.stack(rows) if rows else None,
    )
