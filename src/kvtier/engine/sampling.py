"""Token sampling: greedy, or temperature sampling from a per-request seeded generator."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np
import torch

from kvtier.engine.penalties import History, adjusted_logits, checked_penalties

logger = logging.getLogger(__name__)

# vLLM's SamplingParams refuses a higher temperature; taken the same, a request written
# for vLLM is refused or served alike.
_MAX_TEMPERATURE = 2.0
# vLLM's: a temperature in (0, this) is raised to it, with a warning (a lower one risks
# inf / NaN in vLLM's kernels); below _SAMPLING_EPS (only 0 after that) is greedy.
_MIN_TEMPERATURE = 1e-2
_SAMPLING_EPS = 1e-5


class FinishReason(enum.Enum):
    """Why a request stopped generating."""

    LENGTH = "length"  # produced max_tokens, or reached the model's max_position tokens
    STOP = "stop"  # produced a stop token or, unless ignored, an EOS token
    ABORT = "abort"  # dropped before finishing (its `generate` call or step failed)


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob` of one token at one output position: its raw logprob (from the
    logits before temperature, as vLLM's default `logprobs_mode`) and its rank in the
    vocab (1: the most likely). `decoded_token` is None: the engine has no tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's output tokens and when to stop.

    `temperature == 0` is greedy; as in vLLM, one in (0, 0.01) is raised to 0.01 with a
    warning (so only 0 is greedy). With a temperature, `seed` makes the request's tokens
    reproducible whatever else is in the batch and whatever came before; without a seed
    the engine seeds the request's generator from `EngineConfig.seed` and the request's
    arrival order (`make_generator`), so the same engine seed and the same calls give the
    same tokens, as in vLLM. A value of the wrong type raises TypeError, one out of range
    ValueError, both naming the field; numpy numbers and bools are taken as and stored as
    Python ones; `stop_token_ids` may be any sequence of ints (a 1-D numpy array too) or
    None (none, as in vLLM) and is stored as a tuple.

    Taken at this boundary as vLLM's `SamplingParams` takes them, so code written for
    vLLM runs unchanged: `temperature` in [0, 2] (vLLM refuses more); `seed=-1` means no
    seed and is stored as None (vLLM's convention; other negative seeds are refused).
    As in vLLM, a request stops at `max_tokens` output tokens or when it holds the
    model's `max_position` (vLLM's `max_model_len`) tokens, whichever comes first
    (finish reason "length"); `max_tokens=None` means up to the model's length.
    vLLM's `n`, `detokenize`, `skip_special_tokens` and `stop` are taken at the values
    the engine honours: `n=1`, either `detokenize` (no text is made either way),
    `skip_special_tokens=True` (the text, always "", holds no special tokens; False
    would keep them in a text the engine has no tokenizer to make) and no stop strings
    (None or empty, stored as ()); other values raise ValueError naming the value and
    what to do instead. `logprobs` is taken as vLLM takes it (True is 1); the engine refuses more
    than `EngineConfig.max_logprobs` (vLLM's `max_logprobs`, 20 by default) per request.

    vLLM's `top_k` (an int; 0 or -1: off), `top_p` (in (0, 1]) and `min_p` (in [0, 1])
    filter the temperature-scaled distribution as vLLM's sampler does, in its order:
    `min_p` drops the tokens less likely than `min_p` times the most likely one, `top_k`
    keeps the `top_k` most likely (and any tied with the last), `top_p` the fewest most
    likely whose probabilities sum to at least `top_p` (the most likely always). They
    change sampled requests only: as in vLLM, a greedy one stores them as off.

    vLLM's `repetition_penalty` (> 0; 1: off), `presence_penalty` and
    `frequency_penalty` (in [-2, 2]; 0: off) and `min_tokens` (>= 0, at most
    `max_tokens`) change the logits before temperature, greedy requests' too, as vLLM's
    sampler does (`kvtier.engine.penalties`).
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's, taken at the values the engine honours (it has no tokenizer and makes one
    # completion per prompt); others are refused by value. `logprobs`: as vLLM's, the
    # number of most likely tokens whose raw logprobs are returned beside each sampled
    # token's (-1: the whole vocab; None: none, and no `cumulative_logprob`).
    n: int = 1
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Numpy numbers are checked as Python ones and stored as them (as token ids are).
        # None, as in vLLM: up to the model's length (the engine sets it per request).
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise TypeError(
                    f"max_tokens must be a positive int, got {self.max_tokens!r} "
                    "(or None: up to the model's length)"
                )
            if self.max_tokens <= 0:
                raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
            object.__setattr__(self, "max_tokens", int(self.max_tokens))
        bounds = f"[0, {_MAX_TEMPERATURE:g}]"
        if not isinstance(self.temperature, Real) or _is_bool(self.temperature):
            raise TypeError(f"temperature must be a float in {bounds}, got {self.temperature!r}")
        if not 0 <= self.temperature <= _MAX_TEMPERATURE:  # NaN fails too
            raise ValueError(f"temperature must be in {bounds}, got {self.temperature}")
        object.__setattr__(self, "temperature", float(self.temperature))
        if 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s: raised to %s, as vLLM does",
                self.temperature,
                _MIN_TEMPERATURE,
                _MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", _MIN_TEMPERATURE)
        if _is_int(self.seed) and self.seed == -1:
            object.__setattr__(self, "seed", None)  # vLLM's "no seed"
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63) or -1 (no seed), got {self.seed}")
            object.__setattr__(self, "seed", int(self.seed))
        if not _is_bool(self.ignore_eos):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        stop = self.stop_token_ids
        if stop is None:
            stop = ()  # vLLM's default, so code written for it runs unchanged
        if isinstance(stop, np.ndarray) and stop.ndim == 1:
            stop = stop.tolist()  # numpy ids as Python ones (floats stay floats: refused)
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got {stop!r}")
        if not all(_is_int(t) for t in stop):
            raise TypeError(f"stop_token_ids must hold int token ids, got {stop!r}")
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be >= 0, got {stop!r}")
        # Frozen, but a list given by the caller is stored as a tuple (hashable, immutable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        self._check_vllm_only_fields()
        self._check_filters()
        checked = checked_penalties(
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.min_tokens,
            self.max_tokens,
        )
        for name, value in zip(_PENALTY_FIELDS, checked, strict=True):
            object.__setattr__(self, name, value)

    def _check_filters(self) -> None:
        """Check `top_p`, `top_k` and `min_p` as vLLM does, raising TypeError / ValueError
        naming the field and value; store them as Python numbers (off when greedy)."""
        for name, low_open in (("top_p", True), ("min_p", False)):
            value = getattr(self, name)
            bounds = "(0, 1]" if low_open else "[0, 1]"
            if not isinstance(value, Real) or _is_bool(value):
                raise TypeError(f"{name} must be a float in {bounds}, got {value!r}")
            number = float(value)
            inside = 0 < number <= 1 if low_open else 0 <= number <= 1  # NaN fails too
            if not inside:
                raise ValueError(f"{name} must be in {bounds}, got {value}")
            object.__setattr__(self, name, number)
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int (0 or -1: off), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off), or at least 1, got {self.top_k}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.is_greedy:  # as vLLM: the argmax is taken whatever they say
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    def _check_vllm_only_fields(self) -> None:
        """Take vLLM's `n`, `logprobs`, `detokenize`, `skip_special_tokens` and `stop` at
        the values the engine honours; raise TypeError / ValueError naming the field and
        value otherwise."""
        if not _is_int(self.n):
            raise TypeError(f"n must be an int, got {self.n!r}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")  # vLLM's message
        if self.n != 1:
            raise ValueError(
                f"n={self.n}: the reference engine makes one completion per prompt (n=1); "
                "pass the prompt n times instead (vLLM seeds its n samples seed, seed+1, ...)"
            )
        object.__setattr__(self, "n", 1)
        logprobs = self.logprobs
        if logprobs is True:
            logprobs = 1  # as vLLM
        if logprobs is not None:
            if not _is_int(logprobs):
                raise TypeError(f"logprobs must be an int or None, got {logprobs!r}")
            if logprobs < -1:
                raise ValueError(f"logprobs must be non-negative or -1, got {logprobs}")
            logprobs = int(logprobs)
        object.__setattr__(self, "logprobs", logprobs)
        if not _is_bool(self.detokenize):
            raise TypeError(f"detokenize must be a bool, got {self.detokenize!r}")
        object.__setattr__(self, "detokenize", bool(self.detokenize))
        if not _is_bool(self.skip_special_tokens):
            raise TypeError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if not self.skip_special_tokens:
            raise ValueError(
                "skip_special_tokens=False: the reference engine has no tokenizer and makes "
                "no text to keep special tokens in; read them in the output's token_ids"
            )
        object.__setattr__(self, "skip_special_tokens", True)
        stop = self.stop
        if stop is None or (isinstance(stop, (list, tuple)) and not stop):
            object.__setattr__(self, "stop", ())  # vLLM's default: none
        elif isinstance(stop, str) or (
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)
        ):
            raise ValueError(
                f"stop={stop!r}: stop strings need a tokenizer, which the reference engine "
                "has not; give the stop tokens' ids as stop_token_ids"
            )
        else:
            raise TypeError(f"stop must be a str, a list of str or None, got {stop!r}")

    @property
    def is_greedy(self) -> bool:
        """Return True when the most likely token is always taken."""
        return self.temperature < _SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Return True when a penalty or `min_tokens` may change the logits."""
        return (
            self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def make_generator(self, seed_source: torch.Generator) -> torch.Generator | None:
        """Return a fresh CPU generator for one request, or None when greedy.

        Without `seed`, the generator is seeded with one draw from `seed_source` (the
        engine's, seeded from `EngineConfig.seed`, drawn from once per unseeded
        temperature request as requests arrive); greedy and seeded requests leave it
        untouched. torch's global RNG is neither used nor advanced.
        """
        if self.is_greedy:
            return None
        seed = self.seed
        if seed is None:
            seed = int(torch.randint(2**62, (), generator=seed_source).item())
        return torch.Generator().manual_seed(seed)


_PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def _is_int(value: object) -> bool:
    """Return True for an integer (a numpy one too) that is not a bool."""
    return isinstance(value, Integral) and not _is_bool(value)


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Pick one token per row of `logits` ([num_seqs, vocab_size]).

    First, as vLLM, the rows of requests with penalties or `min_tokens` are changed
    (`adjusted_logits`: `histories[i]` is request i's prompt and output token ids, needed
    then, and `eos_token_ids` the model's EOS ids); a greedy row's argmax is then taken.
    A sampled row is scaled by its request's temperature, filtered by its `min_p`,
    `top_k` and `top_p` (`_filtered`), and one token drawn from what is left.
    `generators[i]` is request i's generator from `SamplingParams.make_generator`; it is
    advanced by one draw per sampled token. Sampling runs on CPU in float32, so results
    do not depend on the device.
    """
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators"
        )
    rows = logits.detach().float().cpu()
    if any(param.adjusts_logits for param in params):  # no tensor work otherwise
        rows = adjusted_logits(rows, params, histories, eos_token_ids)
    tokens: list[int] = []
    for row, param, generator in zip(rows, params, generators, strict=True):
        if param.is_greedy:
            tokens.append(int(row.argmax().item()))
            continue
        if generator is None:
            raise ValueError("temperature sampling needs a generator (make_generator)")
        # Shift so the top logit scales to exactly 0 and the others to <= 0: a tiny
        # temperature (1e-40; 1e-46 is 0 in float32) then sends them to -inf instead of
        # overflowing to inf or dividing 0 by 0 (a NaN softmax).
        top = row.max()
        scaled = torch.where(row == top, 0.0, (row - top) / param.temperature)
        probs = torch.softmax(_filtered(scaled, param), dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens


def _filtered(scaled: torch.Tensor, param: SamplingParams) -> torch.Tensor:
    """Return `scaled` (temperature-scaled logits whose top one is 0) with the tokens
    that `min_p`, then `top_k`, then `top_p` rule out at -inf (vLLM's order). The most
    likely token is never ruled out."""
    out = scaled
    if param.min_p > 0:
        # The top logit is 0, so exp(logit) is each token's probability over the top's.
        out = out.masked_fill(out.exp() < param.min_p, -torch.inf)
    if 0 < param.top_k < out.numel():
        kth = out.topk(param.top_k).values[-1]
        out = out.masked_fill(out < kth, -torch.inf)
    if param.top_p < 1:
        ascending, order = torch.softmax(out, dim=-1).sort()
        # Drop the least likely tokens while those dropped sum to at most 1 - top_p.
        drop = ascending.cumsum(dim=-1) <= 1 - param.top_p
        drop[-1] = False
        out = out.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -torch.inf)
    return out


def finish_reason(
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    *,
    num_tokens: int = 0,
    max_model_len: int | None = None,
) -> FinishReason | None:
    """Return why a request stops after emitting `token_id`, or None to keep going.

    `num_output_tokens` counts the request's output tokens including `token_id`,
    `num_tokens` its prompt and output tokens. As vLLM's `check_stop`, a stop or EOS
    token is STOP; then reaching `max_tokens` (None: no bound here) or `max_model_len`
    tokens in all (None: no cap) is LENGTH.
    """
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if max_model_len is not None and num_tokens >= max_model_len:
        return FinishReason.LENGTH
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None
