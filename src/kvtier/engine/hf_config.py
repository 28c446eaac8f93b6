"""Read a local HF `config.json` into a `ModelConfig`.

Every value is checked for its type before it is used: a malformed file raises
ValueError naming the file, the key and the value, never a TypeError from arithmetic
on a string, and never a silent misreading (`"tie_word_embeddings": "false"` is not true).
The value is shown as JSON, as the file holds it (`true`, `null`, `"x"`), not as Python
shows what the JSON reader made of it (`True`, `None`, `'x'`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.config import SUPPORTED_ARCHITECTURES, AttentionKind, ModelConfig
from kvtier.engine.hf_tokenizer_eos import tokenizer_eos_token_id

logger = logging.getLogger(__name__)

_MISSING = object()
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' LlamaConfig and Qwen2Config defaults, for keys a config.json leaves out.
_LLAMA_DEFAULT_MAX_POSITION = 2048
_LLAMA_DEFAULT_EOS = 2
_QWEN2_DEFAULT_MAX_POSITION = 32768
_QWEN2_DEFAULT_NUM_KV_HEADS = 32
_QWEN2_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28


def read_hf_config(path: str | Path, dtype: torch.dtype = torch.float32) -> ModelConfig:
    """Read a local HF `config.json` (a file or the checkpoint directory holding it).

    Supports LlamaForCausalLM and Qwen2ForCausalLM with default RoPE and SiLU. Read as
    transformers reads them: Llama has no sliding window (a `sliding_window` key is
    ignored); Qwen2's is off unless `use_sliding_window` is true, and then its sliding
    layers come from `layer_types`, else `max_window_layers` (both defaulting as Qwen2Config).
    Keys left out take LlamaConfig's or Qwen2Config's defaults (Llama: eos_token_id 2,
    max_position_embeddings 2048; Qwen2: no eos, 32768, 32 KV heads); a null optional
    value takes the same, but null KV heads are as many as the query heads (both configs).
    A missing required key raises KeyError naming it; any other problem ValueError.

    The EOS tokens are vLLM's: the tokenizer's EOS (`tokenizer_eos_token_id`; where
    the tokenizer files name none, config.json's first `eos_token_id` stands for it)
    and the generation config's `eos_token_id`s, which are a `generation_config.json`'s
    where one lies beside config.json (chat checkpoints name their end-of-turn token
    there alone), else config.json's (transformers' `GenerationConfig.from_model_config`).
    The file replaces config.json's, as in vLLM and transformers: config.json's other
    EOS ids stop nothing then. As vLLM, the generation config's EOS ids but the
    tokenizer's are reported as `stop_reason`
    (`ModelConfig.eos_stop_token_ids`). An EOS id outside the vocab
    (a checkpoint whose vocab was cut down) is left out with a warning: the model can
    never sample it, and vLLM serves such checkpoints too.
    """
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    with config_path.open(encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # JSON is UTF-8
            raise ValueError(f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(hf).__name__}")
    source = str(config_path)
    try:
        config = _from_hf_dict(hf, dtype, source)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    generation_path = config_path.parent / GENERATION_CONFIG_FILE
    more = _in_vocab(_generation_eos_token_ids(generation_path), config.vocab_size, generation_path)
    tokenizer_eos = tokenizer_eos_token_id(config_path.parent)
    tokenizer_ids = _in_vocab(
        () if tokenizer_eos is None else (tokenizer_eos,), config.vocab_size, config_path.parent
    )
    # vLLM's generation config: the file's, else one made from config.json (transformers'
    # from_model_config). Its EOS ids but the tokenizer's (unknown: config.json's first)
    # are the request's stop token ids there, so they are reported as its stop_reason.
    # The tokenizer's EOS is vLLM's even outside the vocab (left out of eos_token_ids).
    generated = more if generation_path.is_file() else config.eos_token_ids
    primary = config.eos_token_ids[:1] if tokenizer_eos is None else (tokenizer_eos,)
    stops = tuple(token for token in dict.fromkeys(generated) if token not in primary)
    # vLLM stops at (and min_tokens masks) these alone: kept in the files' order.
    kept = {*generated, *(config.eos_token_ids[:1] if tokenizer_eos is None else tokenizer_ids)}
    named = dict.fromkeys(config.eos_token_ids + more + tokenizer_ids)
    eos_token_ids = tuple(token for token in named if token in kept)
    return dataclasses.replace(config, eos_token_ids=eos_token_ids, eos_stop_token_ids=stops)


def _in_vocab(eos_token_ids: tuple[int, ...], vocab_size: int, source: object) -> tuple[int, ...]:
    """Return the ids of `eos_token_ids` below `vocab_size`, logging a warning naming
    `source` for the others: never sampled, they could never stop generation (vLLM
    keeps them silently; a hand-built `ModelConfig` refuses them)."""
    beyond = [t for t in eos_token_ids if t >= vocab_size]
    if beyond:
        logger.warning(
            "%s: eos_token_id %s outside the vocab [0, %d) ignored (it can never be sampled)",
            source,
            beyond,
            vocab_size,
        )
    return tuple(t for t in eos_token_ids if t < vocab_size)


def _generation_eos_token_ids(path: Path) -> tuple[int, ...]:
    """Return the `eos_token_id`s of the generation config `path` (none if it is absent);
    raise ValueError naming the file if it is not a JSON object or the value is no id."""
    if not path.is_file():
        return ()
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # JSON is UTF-8
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return _eos_token_ids(data.get("eos_token_id"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _eos_token_ids(eos: Any) -> tuple[int, ...]:
    """Return an `eos_token_id` value (null, an id or a list of ids) as a tuple of ids."""
    eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if any(type(token) is not int or token < 0 for token in eos_token_ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {_json(eos)}")
    return eos_token_ids


def _from_hf_dict(hf: dict[str, Any], dtype: torch.dtype, source: str) -> ModelConfig:
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"architectures must be a list, got {_json(architectures)}")
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"architectures={_json(architectures)} not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f'hidden_act={_json(hf["hidden_act"])} not supported (only "silu")')
    if _hf_bool(hf, "mlp_bias"):
        raise ValueError("mlp_bias=true not supported")
    num_layers = _hf_positive_int(hf, "num_hidden_layers")
    num_heads = _hf_positive_int(hf, "num_attention_heads")
    hidden_size = _hf_positive_int(hf, "hidden_size")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = _hf_bool(hf, "attention_bias")
    window, kinds = _hf_layer_kinds(hf, num_layers, source, is_qwen2)
    # Absent, LlamaConfig's eos_token_id is 2 (Qwen2Config's None); null means none.
    eos_token_ids = _eos_token_ids(hf.get("eos_token_id", None if is_qwen2 else _LLAMA_DEFAULT_EOS))
    vocab_size = _hf_positive_int(hf, "vocab_size")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_hf_positive_int(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_hf_num_kv_heads(hf, num_heads, is_qwen2),
        # absent or null: a head dim from the hidden size, as both configs derive it
        head_dim=_hf_positive_int(hf, "head_dim", hidden_size // num_heads),
        layer_kinds=kinds,
        sliding_window=window,
        rope_theta=_hf_rope_theta(hf),
        rms_norm_eps=_hf_positive_number(hf, "rms_norm_eps", 1e-6),
        max_position=_hf_positive_int(
            hf,
            "max_position_embeddings",
            _QWEN2_DEFAULT_MAX_POSITION if is_qwen2 else _LLAMA_DEFAULT_MAX_POSITION,
        ),
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=attention_bias and not is_qwen2,
        tie_word_embeddings=_hf_bool(hf, "tie_word_embeddings"),
        eos_token_ids=_in_vocab(eos_token_ids, vocab_size, source),
        dtype=dtype,
    )


def _hf_positive_int(hf: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    """Return `hf[key]`, or `default` where it is absent or null (no default: KeyError
    for an absent key, which the caller names)."""
    if key not in hf and default is _MISSING:
        raise KeyError(key)
    value = hf.get(key)
    if value is None and default is not _MISSING:
        return int(default)
    if type(value) is not int or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {_json(value)}")
    return value


def _hf_num_kv_heads(hf: dict[str, Any], num_heads: int, is_qwen2: bool) -> int:
    """Return the KV heads as transformers reads them: null, and absent for Llama, as many
    as query heads; absent for Qwen2, Qwen2Config's 32, which must divide the heads."""
    if is_qwen2 and "num_key_value_heads" not in hf:
        if num_heads % _QWEN2_DEFAULT_NUM_KV_HEADS:
            raise ValueError(
                f"num_key_value_heads is absent, so Qwen2Config's default of "
                f"{_QWEN2_DEFAULT_NUM_KV_HEADS} applies, which num_attention_heads={num_heads} "
                "is not a multiple of; set num_key_value_heads"
            )
        return _QWEN2_DEFAULT_NUM_KV_HEADS
    return _hf_positive_int(hf, "num_key_value_heads", num_heads)


def _hf_positive_number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a finite number > 0, got {_json(value)}")
    return float(value)


def _hf_bool(hf: dict[str, Any], key: str, default: bool = False) -> bool:
    value = hf.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false, got {_json(value)}")
    return value


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older files use
    # top-level `rope_theta` and `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters (or rope_scaling) must be an object, got {_json(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f'rope_type={_json(rope_type)} not supported (only "default")')
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if type(theta) not in (int, float) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a finite number > 0, got {_json(theta)}")
    return float(theta)


def _hf_layer_kinds(
    hf: dict[str, Any], num_layers: int, source: str, is_qwen2: bool
) -> tuple[int | None, tuple[AttentionKind, ...]]:
    # transformers' LlamaAttention never slides; Qwen2Config defaults use_sliding_window
    # to false, sliding_window to 4096 and max_window_layers to 28.
    use_window = is_qwen2 and _hf_bool(hf, "use_sliding_window")
    window = hf.get("sliding_window", _QWEN2_DEFAULT_WINDOW) if use_window else None
    if window is None:
        return None, (AttentionKind.FULL,) * num_layers
    names = {"full_attention": AttentionKind.FULL, "sliding_attention": AttentionKind.SLIDING}
    if hf.get("layer_types") is not None:
        if not isinstance(hf["layer_types"], list):
            raise ValueError(f"layer_types must be a list, got {_json(hf['layer_types'])}")
        unknown = [t for t in hf["layer_types"] if not (isinstance(t, str) and t in names)]
        if unknown:
            shown = ", ".join(dict.fromkeys(map(_json, unknown)))  # each once, in file order
            raise ValueError(f"layer_types {shown} not supported")
        kinds = tuple(names[t] for t in hf["layer_types"])
    else:
        first_sliding = hf.get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        if type(first_sliding) is not int or first_sliding < 0:
            raise ValueError(f"max_window_layers must be an int >= 0, got {_json(first_sliding)}")
        kinds = tuple(
            AttentionKind.SLIDING if i >= first_sliding else AttentionKind.FULL
            for i in range(num_layers)
        )
    if AttentionKind.SLIDING not in kinds:
        return None, kinds
    window = _hf_positive_int(hf, "sliding_window", _QWEN2_DEFAULT_WINDOW)
    logger.info("%s: sliding window of %d tokens on %d layers", source, window,
                kinds.count(AttentionKind.SLIDING))  # fmt: skip
    return window, kinds


def _json(value: object) -> str:
    """Return a value read from a JSON file as JSON shows it, for an error message."""
    return json.dumps(value, ensure_ascii=False)
