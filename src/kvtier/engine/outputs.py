"""What the reference engine returns per request (`RequestOutput`, made by `output_of`) and
counts (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import FinishReason, Logprob


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's `CompletionOutput` of a request's one completion (`index` 0: the engine
    makes one per prompt), so code reading `output.outputs[0]` runs unchanged.

    `token_ids` is a list, as vLLM's. `text` is "" (the engine has no tokenizer: as
    vLLM's with `detokenize=False`). With `SamplingParams.logprobs` set, `logprobs`
    holds per output token its `Logprob` and the top ones' (`keep_sampled`) and
    `cumulative_logprob` their sum; both are None otherwise, as vLLM's. `stop_reason` is
    the stop token id that ended it (one of `SamplingParams.stop_token_ids`), None when
    an EOS token, `max_tokens` or an abort did, as in vLLM.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Return True once the completion has a finish reason (as vLLM's)."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One finished request: its tokens, timing and where its prefix came from.

    `num_local_hit_tokens` / `num_external_hit_tokens`: the prompt tokens taken from
    the GPU cache / from kvtier's tiers (loaded) by the admission its first token came
    from; a later re-admission (after a preemption) does not count. `logits` holds, when
    `EngineConfig.keep_logits` is set, the float32 logits each output token was sampled
    from ([num_output_tokens, vocab_size]).

    vLLM's `RequestOutput` fields are there too, with vLLM's types: `prompt` (a
    `TokensPrompt`'s text, None without one), `prompt_token_ids` (a list), `outputs`
    (one `CompletionOutput`), `finished` (True) and `num_cached_tokens` (the prompt
    tokens not computed at that admission: both hit counts).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float
    tpot_s: float
    num_local_hit_tokens: int
    num_external_hit_tokens: int
    logits: torch.Tensor | None = None
    prompt: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0


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


def output_of(request: Request, model: ModelConfig) -> RequestOutput:
    """Return the `RequestOutput` of a finished request (its kept logits stacked) of an
    engine running `model` (whose EOS ids but its `eos_stop_token_ids` stop a request
    with no `stop_reason`, as vLLM's tokenizer EOS does)."""
    rows = request.kept_logits
    reason = request.finish_reason
    no_logprobs = request.params.logprobs is None
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=list(request.output_token_ids),
        cumulative_logprob=None if no_logprobs else request.cumulative_logprob,
        logprobs=None if no_logprobs else list(request.sample_logprobs),
        finish_reason=reason.value if reason else None,
        stop_reason=_stop_reason(request, model),
    )
    num_local, num_external = request.num_local_tokens_total, request.num_external_tokens_total
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=tuple(request.output_token_ids),
        finish_reason=reason.value if reason else "",
        ttft_s=request.ttft or 0.0,
        tpot_s=request.tpot or 0.0,
        num_local_hit_tokens=num_local,
        num_external_hit_tokens=num_external,
        logits=torch.stack(rows) if rows else None,
        prompt=request.prompt,
        outputs=[completion],
        finished=request.finish_reason is not None,
        num_cached_tokens=num_local + num_external,
    )


def _stop_reason(request: Request, model: ModelConfig) -> int | None:
    """Return the stop token id that finished `request`, or None. As vLLM checks its EOS
    first, a silent EOS token (unless `ignore_eos`) stops with None even if it is a stop
    id; an EOS id of `model.eos_stop_token_ids` is a stop id there (not with ignore_eos)."""
    if request.finish_reason is not FinishReason.STOP or not request.output_token_ids:
        return None
    token, params = request.output_token_ids[-1], request.params
    eos_stops = () if params.ignore_eos else model.eos_stop_token_ids
    if not params.ignore_eos and token in model.eos_token_ids and token not in eos_stops:
        return None
    return token if token in params.stop_token_ids or token in eos_stops else None
