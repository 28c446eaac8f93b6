"""vLLM's penalties and `min_tokens`: the logits a request's history changes before sampling.

As vLLM 0.33's sampler, on the float32 logits before temperature and the `min_p` /
`top_k` / `top_p` filters (so they change greedy requests too), in its order:

1. `min_tokens`: while a request has fewer output tokens, its stop tokens are at -inf
   (vLLM's `all_stop_token_ids`: the model's EOS ids, even with `ignore_eos`, and the
   request's `stop_token_ids`), so it cannot stop early.
2. `repetition_penalty`: each token in its prompt or output so far has a positive logit
   divided by it, a negative one multiplied by it (> 1 discourages repeating). Divided
   as vLLM's CUDA kernel (`apply_repetition_penalties_`) divides, in float32; vLLM's
   CPU fallback multiplies by 1/penalty instead, which may differ in the last bit.
3. `frequency_penalty` times the token's count in the output so far, then
   `presence_penalty` once for a token in the output, are subtracted (OpenAI's
   definition; the prompt does not count).

The logits returned for logprobs stay raw (vLLM's default `logprobs_mode`): these change
a copy. Rows of requests without penalties or `min_tokens` are left as they are, and a
batch without any costs no tensor work (`sample` checks `adjusts_logits` first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtier.engine.sampling import SamplingParams

History = tuple[Sequence[int], Sequence[int]]
"""A request's prompt token ids and its output token ids so far."""


def checked_penalties(
    presence: object, frequency: object, repetition: object, min_tokens: object, max_tokens: object
) -> tuple[float, float, float, int]:
    """Return the penalties as floats and `min_tokens` as an int, checked as vLLM's
    `SamplingParams` checks them; raise TypeError naming a value of the wrong type and
    ValueError (vLLM's message) one out of range."""
    numbers = []
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not isinstance(value, Real) or _is_bool(value):
            raise TypeError(f"{name} must be a float in [-2, 2], got {value!r}")
        numbers.append(float(value))
        if not -2.0 <= numbers[-1] <= 2.0:  # NaN fails too
            raise ValueError(f"{name} must be in [-2, 2], got {value}.")
    if not isinstance(repetition, Real) or _is_bool(repetition):
        raise TypeError(f"repetition_penalty must be a float > 0, got {repetition!r}")
    if not math.isfinite(float(repetition)):
        raise ValueError(f"repetition_penalty must be a finite number, got {repetition}.")
    if float(repetition) <= 0.0:
        raise ValueError(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not isinstance(min_tokens, Integral) or _is_bool(min_tokens):
        raise TypeError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    count = int(min_tokens)
    if count < 0:
        raise ValueError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if isinstance(max_tokens, int) and count > max_tokens:
        raise ValueError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    return numbers[0], numbers[1], float(repetition), count


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))


def adjusted_logits(
    rows: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History] | None,
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """Return `rows` (float32 logits, one row per request) with each row whose params
    `adjusts_logits` changed as vLLM's sampler changes it (see the module's docstring);
    `rows` itself is not changed. `histories[i]` is request i's prompt and output token
    ids, `stop_ids` the model's EOS ids (`min_tokens` masks them and its stop ids)."""
    if histories is None or len(histories) != len(params):
        raise ValueError(
            "penalties and min_tokens need each request's prompt and output token ids "
            f"(histories): got {None if histories is None else len(histories)} "
            f"for {len(params)} requests"
        )
    out = rows.clone()
    for index, (param, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        if param.adjusts_logits:
            out[index] = _adjusted_row(out[index], param, prompt, output, stop_ids)
    return out


def _adjusted_row(
    row: torch.Tensor,
    param: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    stop_ids: Sequence[int],
) -> torch.Tensor:
    vocab = row.numel()
    if len(output) < param.min_tokens:
        stops = {t for t in (*stop_ids, *param.stop_token_ids) if 0 <= t < vocab}
        row = row.index_fill(0, torch.tensor(sorted(stops), dtype=torch.long), -math.inf)
    penalty = param.repetition_penalty
    if penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], dtype=torch.long)] = True
        penalized = torch.where(row > 0, row / penalty, row * penalty)
        row = torch.where(seen, penalized, row)
    if output and (param.frequency_penalty != 0.0 or param.presence_penalty != 0.0):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
        row = row - param.frequency_penalty * counts.to(row.dtype)
        row = row - param.presence_penalty * (counts > 0).to(row.dtype)
    return row
