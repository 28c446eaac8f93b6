"""A checkpoint's default sampling parameters, from its `generation_config.json`.

As vLLM's `LLM.get_default_sampling_params` (`ModelConfig.get_diff_sampling_param`):
the file's `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `temperature`,
`top_k`, `top_p`, `min_p`, `max_new_tokens` (vLLM's `max_tokens`) and
`skip_special_tokens` are the defaults of a `generate` call given no sampling params;
what the file leaves out keeps `SamplingParams`' default. The engine makes no text, so
a `skip_special_tokens` of false (keep them in the text) is not applied, with a warning
saying so, rather than refusing a checkpoint vLLM serves. vLLM reads the file through transformers'
`GenerationConfig.to_diff_dict`, which drops the values equal to transformers' defaults:
with transformers 5 (vLLM 0.33's) every default is None, so each value the file gives is
kept (a `top_k` of 50 too). The penalties apply to greedy requests too, as in vLLM. The
engine's `SamplingParams()` is greedy where vLLM's samples at temperature 1.0: a file
giving `top_k`, `top_p` or `min_p` but no `temperature` leaves them off here (greedy),
with a warning saying so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvtier.engine.hf_config import GENERATION_CONFIG_FILE
from kvtier.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

# The file's key -> SamplingParams' field.
_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
    "skip_special_tokens": "skip_special_tokens",
}


def default_sampling_params(model: str | Path | object) -> SamplingParams:
    """Return the defaults for `generate` calls given no sampling params: from the
    `generation_config.json` of the checkpoint directory `model` names (or beside the
    config.json it names), else `SamplingParams()`. Raise ValueError naming the file for
    a value `SamplingParams` refuses (the file is read as `ModelConfig.from_hf_config`
    reads it, which names a file that is no JSON object)."""
    if not isinstance(model, (str, Path)):
        return SamplingParams()
    directory = Path(model) if Path(model).is_dir() else Path(model).parent
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingParams()
    with path.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)  # read already by ModelConfig.from_hf_config
    fields = {field: data[key] for key, field in _FIELDS.items() if data.get(key) is not None}
    if fields.get("skip_special_tokens") is False:
        del fields["skip_special_tokens"]
        logger.warning(
            "%s sets skip_special_tokens=false: not applied, the engine has no tokenizer and "
            "makes no text (special tokens are in the outputs' token_ids)",
            path,
        )
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if fields:
        shown = ", ".join(f"{field}={value}" for field, value in fields.items())
        logger.info("%s sets the default sampling params: %s", path, shown)
    filters = {name: fields[name] for name in ("top_k", "top_p", "min_p") if name in fields}
    if filters and "temperature" not in fields:
        # vLLM's SamplingParams() samples at temperature 1.0; the engine's is greedy.
        logger.warning(
            "%s sets %s but no temperature: greedy here (SamplingParams()' temperature is 0),"
            " so they are off, where vLLM (its default temperature 1.0) samples with them;"
            " give a temperature to sample",
            path,
            ", ".join(f"{name}={value}" for name, value in filters.items()),
        )
    return params
