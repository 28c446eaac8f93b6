"""Checks on what callers hand the reference engine, made before anything is queued.

A request that could never run (a token id outside the vocab, a prompt that leaves the
model no position for an output token, more KV blocks than the whole GPU pool), or
names a stop id it could never sample, is refused here with a message that names it,
instead of failing inside a step after compute was spent on it (or running on to
`max_tokens`). An output that would pass the model's positions is cut there, as vLLM.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from numbers import Integral
from pathlib import Path
from typing import TypeAlias, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from kvtier.core.kv_groups import GroupKind, KVLayout
from kvtier.core.plural import counted
from kvtier.engine.config import EngineConfig, ModelConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

T = TypeVar("T")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may use: its vocab, its positions, the usable GPU pool and
    `EngineConfig.max_logprobs` (-1: no cap)."""

    vocab_size: int
    max_position: int
    layout: KVLayout
    num_usable_blocks: int
    max_logprobs: int


TOKENS_KEY = "prompt_token_ids"
"""The key of a vLLM `TokensPrompt` dict the engine runs (it has no tokenizer)."""
TEXT_KEY = "prompt"
"""A `TokensPrompt`'s text of its token ids, beside them: carried by vLLM, not tokenized."""

TokenPrompt: TypeAlias = Sequence[int] | Mapping[str, object]
"""One prompt: its token ids, or vLLM's `TokensPrompt` dict `{"prompt_token_ids": ids}`."""


def as_prompt(prompt: object, where: str) -> tuple[list[int], str | None]:
    """Return `prompt`'s token ids as a list of ints, and its text (None: none); raise
    TypeError naming `where` otherwise.

    Accepts a sequence of ints (numpy integers included), a 1-D integer numpy array or
    torch tensor, or vLLM's `TokensPrompt`: a mapping whose `"prompt_token_ids"` holds
    one of those. As in vLLM, its text `"prompt"` beside the ids is not tokenized but
    carried (the ids run; it must be a str; an empty one is no text), and a key whose
    value vLLM reads as no value (None, or an empty dict, list, tuple or str, such as
    `"multi_modal_data": {}`) counts as absent. A str is refused: the engine has no
    tokenizer. So is any other key holding a value (a text `"prompt"` alone,
    `"multi_modal_data"`, `"cache_salt"`, ...), by name, rather than ignored.
    """
    if isinstance(prompt, Mapping):
        ids, text = _tokens_of(prompt, where)
        return _plain_token_ids(ids, f"{where}'s {TOKENS_KEY!r}"), text
    return _plain_token_ids(prompt, where), None


def _is_no_value(key: object, value: object) -> bool:
    """Return True for a prompt dict value vLLM reads as no value: None, or (but for the
    token ids, whose emptiness is refused as an empty prompt) an empty str, bytes, dict,
    list or tuple, which vLLM's `if value := prompt.get(key)` tests skip."""
    if value is None:
        return True
    empty = isinstance(value, (str, bytes, Mapping, list, tuple)) and len(value) == 0
    return empty and key != TOKENS_KEY


def _tokens_of(prompt: Mapping[object, object], where: str) -> tuple[object, str | None]:
    """Return the `"prompt_token_ids"` value of a `TokensPrompt` dict and its text; raise
    TypeError naming the keys the engine does not take, or the missing key."""
    given = {key: value for key, value in prompt.items() if not _is_no_value(key, value)}
    has_ids = TOKENS_KEY in given
    others = [key for key in given if key != TOKENS_KEY and not (has_ids and key == TEXT_KEY)]
    if others:
        names = ", ".join(f"{key!r} (text)" if key == TEXT_KEY else repr(key) for key in others)
        raise TypeError(
            f"{where} has key{'s' if len(others) > 1 else ''} {names}, which the reference "
            f"engine does not take: it has no tokenizer and takes only {TOKENS_KEY!r}"
        )
    if not has_ids:
        if TOKENS_KEY in prompt:
            raise TypeError(f"{where}'s {TOKENS_KEY!r} is None: give the prompt's token ids")
        if not prompt:
            raise TypeError(f"{where} is an empty dict: give its token ids as {TOKENS_KEY!r}")
        raise TypeError(f"{where} has no {TOKENS_KEY!r}: give the prompt's token ids there")
    text = given.get(TEXT_KEY)
    if text is not None and not isinstance(text, str):
        raise TypeError(
            f"{where}'s {TEXT_KEY!r} must be the text of its token ids (a str), got {_shown(text)}"
        )
    return given[TOKENS_KEY], text


def _plain_token_ids(prompt: object, where: str) -> list[int]:
    if isinstance(prompt, (str, bytes)):
        raise TypeError(
            f"{where} is a {type(prompt).__name__}: the engine takes token ids, not text "
            "(it has no tokenizer)"
        )
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return _array_token_ids(prompt, where)
    if not isinstance(prompt, Sequence):
        raise TypeError(f"{where} must be a sequence of token ids, got {prompt!r}")
    for position, token in enumerate(prompt):
        if not isinstance(token, Integral) or isinstance(token, bool):
            raise TypeError(f"{where}: token {position} is {token!r}, not an int token id")
    return [int(token) for token in prompt]


def _array_token_ids(prompt: np.ndarray | torch.Tensor, where: str) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        dtype = prompt.dtype
        is_integer = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    else:
        is_integer = bool(np.issubdtype(prompt.dtype, np.integer))
    if prompt.ndim != 1 or not is_integer:
        raise TypeError(
            f"{where} must be a 1-D integer array of token ids, got {prompt.ndim}-D {prompt.dtype}"
        )
    return [int(token) for token in prompt.tolist()]


def as_prompt_list(prompts: object) -> Sequence[object]:
    """Return `prompts` if it is a sequence of prompts, or a one-prompt list if it is
    one prompt: a prompt dict, or (as vLLM's `generate([1, 2, 3])`) a list whose first
    item is an int; raise TypeError naming the value otherwise. Another sequence of ints
    (a tuple, a range) is refused, as vLLM refuses it (it reads it as prompts, each an
    int).

    An array or tensor is refused (as vLLM refuses one), with the `.tolist()` call to
    pass instead: a 2-D one's rows may hold padding. Each prompt may be a 1-D array or a
    prompt dict (`as_token_ids`).
    """
    if isinstance(prompts, Mapping):
        return [prompts]
    expected = "prompts must be a list of prompts (token id lists or TokensPrompt dicts)"
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        hints = {
            1: ": pass generate([ids.tolist()]) for one prompt",
            2: ": pass generate(ids.tolist()), one prompt per row (its padding included)",
        }
        raise TypeError(
            f"{expected}, got a {prompts.ndim}-D "
            f"{type(prompts).__name__}{hints.get(prompts.ndim, '')}"
        )
    if isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"{expected}, got {_shown(prompts)}: the engine takes token ids, not text "
            "(it has no tokenizer)"
        )
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"{expected} or one prompt, got {_shown(prompts)}: pass [[1, 2, 3]] or "
            f"[{{{TOKENS_KEY!r}: [1, 2, 3]}}]"
        )
    if prompts and isinstance(prompts[0], Integral):
        if isinstance(prompts, list):  # one prompt's token ids, as vLLM
            return [prompts]
        # vLLM takes it as a sequence of prompts and refuses each int: so is it here.
        raise TypeError(
            f"{expected}, got a {type(prompts).__name__} of token ids {_shown(prompts)}: "
            "as in vLLM, only a list of ints is one prompt: pass list(ids) or [ids]"
        )
    return prompts


def _shown(value: object) -> str:
    """Return `value` for an error: its repr, shortened, and its type."""
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def progress_bar_maker(show: object) -> Callable[..., tqdm]:
    """Return what makes `generate`'s progress bar over its requests: none (a disabled
    bar) for None or False, tqdm's for True, or (as vLLM's `use_tqdm`) what a callable
    returns when called as vLLM calls it; raise TypeError naming any other value."""
    if show is None or isinstance(show, bool):
        return partial(tqdm, disable=not show, unit="req")
    if not callable(show):
        raise TypeError(
            "show_progress / use_tqdm must be a bool, None or a callable making a tqdm "
            f"progress bar (vLLM's use_tqdm), got {_shown(show)}"
        )
    return partial(show, desc="Processed prompts", dynamic_ncols=True)


def one_spelling(name: str, value: T | None, vllm_name: str, vllm_value: T | None) -> T | None:
    """Return the argument given as `name` or as vLLM's `vllm_name` (None: neither);
    raise TypeError naming both when both are given (not None)."""
    if value is not None and vllm_value is not None:
        raise TypeError(
            f"generate() got both {name}= and {vllm_name}= (vLLM's name for {name}): pass one"
        )
    return vllm_value if value is None else value


def as_params_list(
    params: object, num_prompts: int, default: SamplingParams
) -> list[SamplingParams]:
    """Return one `SamplingParams` per prompt from None (`default`), one params, or a
    sequence of them."""
    if params is None:
        return [default] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(
            "params must be a SamplingParams, a sequence of them (one per prompt) or None, "
            f"got {params!r}"
        )
    for index, item in enumerate(params):
        if not isinstance(item, SamplingParams):
            raise TypeError(f"params[{index}] must be a SamplingParams, got {item!r}")
    if len(params) != num_prompts:
        raise ValueError(
            f"{counted(num_prompts, 'prompt')} but {counted(len(params), 'sampling param')}"
        )
    return list(params)


def as_session_list(session_ids: object, num_prompts: int) -> list[str | None]:
    """Return one session id per prompt (None: all None); TypeError/ValueError name a bad value."""
    if session_ids is None:
        return [None] * num_prompts
    if not isinstance(session_ids, Sequence) or isinstance(session_ids, str):
        raise TypeError(f"session_ids must be a sequence of str or None, got {session_ids!r}")
    if len(session_ids) != num_prompts:
        raise ValueError(
            f"session_ids must give one id per prompt ({num_prompts}), got {session_ids!r}"
        )
    for session_id in session_ids:
        if session_id is not None and not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str or None, got {session_id!r}")
    return list(session_ids)


def check_request(
    token_ids: Sequence[int], params: SamplingParams, limits: RequestLimits, where: str
) -> SamplingParams:
    """Return the params the request runs with, or raise ValueError, naming `where`, if
    it could never run, or names a stop token outside the vocab.

    As in vLLM, the model's `max_position` is its `max_model_len`: a prompt must leave
    room for one output token (at most `max_position - 1` tokens), a request stops
    when it holds `max_position` tokens (finish reason "length") even short of
    `max_tokens`, and `max_tokens=None` is set to `max_position - len(token_ids)` in the
    params returned (the given ones otherwise).

    The request's last sampled token is never fed back, so it computes one position
    less than the tokens it holds at most; the KV blocks (over every group) of the
    position needing the most (`num_peak_blocks`) must fit the usable GPU pool.
    """
    if not token_ids:
        raise ValueError(f"{where}: empty prompt")
    bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} outside the vocab [0, {limits.vocab_size})")
    # Never sampled, they would never stop it (as vLLM, which refuses them too).
    bad = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(
            f"{where}: stop_token_ids {bad[:5]} outside the vocab [0, {limits.vocab_size}): "
            "they could never stop it"
        )
    if params.logprobs is not None and params.logprobs > limits.vocab_size:
        raise ValueError(
            f"{where}: logprobs={params.logprobs}, more than the vocab's "
            f"{limits.vocab_size} tokens (-1 asks for them all)"
        )
    _check_logprobs_cap(params.logprobs, limits, where)
    num_prompt, max_len = len(token_ids), limits.max_position
    if num_prompt >= max_len:
        room = "is longer than" if num_prompt > max_len else "leaves no room for an output within"
        raise ValueError(
            f"{where}: prompt of {counted(num_prompt, 'token')} {room} the model's "
            f"max_position={max_len} (vLLM's max_model_len): give at most {max_len - 1} "
            "prompt tokens"
        )
    given = params.max_tokens
    if given is None:  # as vLLM: up to the model's length
        params = dataclasses.replace(params, max_tokens=max_len - num_prompt)
    asked = num_prompt + (params.max_tokens or 0)
    num_blocks = num_peak_blocks(limits.layout, min(asked, max_len) - 1)
    if num_blocks > limits.num_usable_blocks:
        capped = f", capped at max_position={max_len}" if given is None or asked > max_len else ""
        raise ValueError(
            f"{where}: prompt of {counted(num_prompt, 'token')} + max_tokens={given}"
            f"{capped} needs at least {num_blocks} KV blocks at one step, more than the GPU "
            f"pool's {counted(limits.num_usable_blocks, 'usable block')} (raise "
            "EngineConfig.num_gpu_blocks or lower max_tokens)"
        )
    return params


def _check_logprobs_cap(logprobs: int | None, limits: RequestLimits, where: str) -> None:
    """Raise ValueError, naming `where` and the value, if `logprobs` asks for more than
    `limits.max_logprobs` (as vLLM refuses more than its `max_logprobs`)."""
    cap = limits.max_logprobs
    if logprobs is None or cap == -1:
        return
    num = limits.vocab_size if logprobs == -1 else logprobs
    if num > cap:
        asked = f"logprobs={logprobs}" + (f" (the whole vocab, {num})" if logprobs == -1 else "")
        raise ValueError(
            f"{where}: {asked} is more than max_logprobs={cap}: ask for at most {cap}, "
            "or raise EngineConfig.max_logprobs (-1: no cap), as vLLM's --max-logprobs"
        )


def num_peak_blocks(layout: KVLayout, num_tokens: int) -> int:
    """Return the GPU blocks a request needs at least at some step computing its first
    `num_tokens` positions: the most any one position needs (a step computes at least
    one): every block of a full-attention group up to it, the blocks a sliding-window
    group's window of it spans. The scheduler drops the blocks before that window.

    The last position is not always the peak: a window that starts within a block spans
    one block more than one starting at a block's first token. The count repeats with
    the block size, so the last `max block size` positions hold the peak.
    """
    span = max(group.block_size for group in layout.groups)
    return max(_num_blocks_at(layout, p) for p in range(max(0, num_tokens - span), num_tokens))


def _num_blocks_at(layout: KVLayout, position: int) -> int:
    total = 0
    for group in layout.groups:
        first = 0
        if group.kind is GroupKind.SLIDING_WINDOW and group.sliding_window is not None:
            first = max(0, position - group.sliding_window + 1) // group.block_size
        total += position // group.block_size + 1 - first
    return total


def check_arguments(model: object, kv_offload: object, engine: object) -> None:
    """Raise TypeError unless `LLM`'s arguments have the types it takes."""
    if model is not None and not isinstance(model, (str, Path, ModelConfig)):
        raise TypeError(
            "model must be a local checkpoint directory (str or Path), a ModelConfig or "
            f"None, got {model!r}"
        )
    if kv_offload is not None and not isinstance(kv_offload, OffloadConfig):
        hint = (
            " (build one with OffloadConfig.from_dict)" if isinstance(kv_offload, Mapping) else ""
        )
        raise TypeError(
            f"kv_offload must be an OffloadConfig or None, got {type(kv_offload).__name__}{hint}"
        )
    if engine is not None and not isinstance(engine, EngineConfig):
        hint = " (build one with EngineConfig(**values))" if isinstance(engine, Mapping) else ""
        raise TypeError(
            f"engine must be an EngineConfig or None, got {type(engine).__name__}{hint}"
        )
