"""A checkpoint's EOS ids are reported as vLLM reports them: its tokenizer's EOS stops a
request with no `stop_reason`; the generation config's other EOS ids (vLLM adds them to
the request's `stop_token_ids`) stop it with the id as `stop_reason`. The tokenizer's
EOS (read from its files: the engine has no tokenizer) stops generation too, as in vLLM.

Regression: every EOS id gave `stop_reason` None, where vLLM names the generation
config's extra ones (Qwen2-Instruct: tokenizer EOS <|im_end|> 151645, generation config
[151645, 151643]: vLLM reports 151643 as the stop_reason), and a tokenizer EOS named in
neither config did not stop generation. A legacy `special_tokens_map.json`'s
eos_token, which transformers takes over tokenizer_config.json's when that has no
added_tokens_decoder, was not read ('assert ((2, 7), (7,)) == ((2, 7), (2,))').
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.model import build_model
from kvtier.engine.sampling import SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
IM_END = "<|im_end|>"
NO_ID = 'no id found for eos_token "<|im_end|>"'


def _write(path: Path, name: str, data: object) -> None:
    (path / name).write_text(json.dumps(data))


def _tokenizer_config(token_id: int) -> dict[str, Any]:
    return {"eos_token": IM_END, "added_tokens_decoder": {str(token_id): {"content": IM_END}}}


def _tokenizer_json(token_id: int, added: bool) -> dict[str, Any]:
    if added:
        return {"added_tokens": [{"id": token_id, "content": IM_END}], "model": {"vocab": {}}}
    return {"added_tokens": [], "model": {"vocab": {"a": 0, IM_END: token_id}}}


@pytest.mark.parametrize(
    ("config_eos", "generation", "files", "eos", "stops"),
    [
        # Qwen2-Instruct's shape: the tokenizer's EOS is silent, the other is a stop id.
        (2, [7, 2], {"tokenizer_config.json": _tokenizer_config(7)}, (2, 7), (2,)),
        # No tokenizer files: config.json's first EOS stands for the tokenizer's.
        (2, [7, 2], {}, (2, 7), (7,)),
        # No generation_config.json: vLLM makes one from config.json.
        ([2, 5, 9], None, {"tokenizer_config.json": {"eos_token": IM_END},
                           "tokenizer.json": _tokenizer_json(9, added=True)}, (2, 5, 9), (2, 5)),
        # A tokenizer EOS in neither config stops too (and is silent).
        (2, None, {"tokenizer_config.json": {"eos_token": {"content": IM_END}},
                   "tokenizer.json": _tokenizer_json(11, added=False)}, (2, 11), (2,)),
        (None, {"temperature": 0.5}, {"tokenizer_config.json": _tokenizer_config(7)}, (7,), ()),
        # A tokenizer EOS outside the vocab (never sampled) is still vLLM's primary EOS:
        # config.json's first EOS does not stand for it, both generation ids are stop ids.
        (2, [2, 7], {"tokenizer_config.json": _tokenizer_config(500)}, (2, 7), (2, 7)),
        # transformers (5) reads a legacy special_tokens_map.json when tokenizer_config.json
        # has no added_tokens_decoder, and its eos_token wins over tokenizer_config.json's.
        (2, [7, 2], {"tokenizer_config.json": {"eos_token": "</s>"},
                     "special_tokens_map.json": {"eos_token": {"content": IM_END}},
                     "tokenizer.json": _tokenizer_json(7, added=False)}, (2, 7), (2,)),
        (2, [7, 2], {"tokenizer_config.json": {},
                     "special_tokens_map.json": {"eos_token": IM_END},
                     "tokenizer.json": _tokenizer_json(7, added=True)}, (2, 7), (2,)),
        # With an added_tokens_decoder, transformers reads no special_tokens_map.json.
        (2, [7, 2], {"tokenizer_config.json": _tokenizer_config(7),
                     "special_tokens_map.json": {"eos_token": "a"},
                     "tokenizer.json": _tokenizer_json(7, added=False)}, (2, 7), (2,)),
        # A generation_config.json replaces config.json's EOS ids (vLLM reads the file
        # alone, as transformers' GenerationConfig.from_pretrained): 2 and 5 stop nothing.
        ([2, 5], [7, 9], {"tokenizer_config.json": _tokenizer_config(7)}, (7, 9), (9,)),
        ([2, 5], {"temperature": 0.5}, {"tokenizer_config.json": _tokenizer_config(7)},
         (7,), ()),
    ],
    ids=["qwen2-instruct", "no-tokenizer", "no-generation-config", "vocab-token", "only-tok",
         "tokenizer-eos-outside-vocab", "special-map-wins", "special-map-only",
         "special-map-unread", "generation-replaces-config", "generation-without-eos"],
)  # fmt: skip
def test_eos_stop_token_ids_are_the_generation_eos_ids_but_the_tokenizers(
    tmp_path: Path,
    config_eos: Any,
    generation: Any,
    files: dict[str, Any],
    eos: tuple[int, ...],
    stops: tuple[int, ...],
) -> None:
    _write(tmp_path, "config.json", {**TINY_HF_CONFIG, "eos_token_id": config_eos})
    if generation is not None:
        body = generation if isinstance(generation, dict) else {"eos_token_id": generation}
        _write(tmp_path, "generation_config.json", body)
    for name, data in files.items():
        _write(tmp_path, name, data)
    config = ModelConfig.from_hf_config(tmp_path)
    assert (config.eos_token_ids, config.eos_stop_token_ids) == (eos, stops)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"tokenizer_config.json": "{bad"}, "could not be read"),
        ({"tokenizer_config.json": {"eos_token": 5}}, "eos_token is 5, not a token"),
        ({"tokenizer_config.json": {"eos_token": "</s>"}}, 'no id found for eos_token "</s>"'),
        # Malformed in other ways (s32 mutation run: each one unchecked went unnoticed,
        # most as a crash, so a bad tokenizer file refused the checkpoint).
        ({"tokenizer_config.json": "[1]"}, "tokenizer_config.json is no JSON object"),
        ({"tokenizer_config.json": {}, "special_tokens_map.json": {"eos_token": 5}},
         "special_tokens_map.json: eos_token is 5, not a token"),
        ({"tokenizer_config.json": {"eos_token": IM_END,
                                    "added_tokens_decoder": {"x": {"content": IM_END}}}}, NO_ID),
        ({"tokenizer_config.json": {"eos_token": IM_END,
                                    "added_tokens_decoder": {"7": IM_END}}}, NO_ID),
        # A key str.isdigit takes for a number though int() refuses it (s32 review).
        ({"tokenizer_config.json": {"eos_token": IM_END,
                                    "added_tokens_decoder": {"\u00b2": {"content": IM_END}}}},
         NO_ID),
        ({"tokenizer_config.json": {"eos_token": IM_END},
          "tokenizer.json": {"added_tokens": [{"id": "7", "content": IM_END}]}}, NO_ID),
        ({"tokenizer_config.json": {"eos_token": IM_END},
          "tokenizer.json": {"added_tokens": None, "model": {"vocab": {IM_END: -1}}}}, NO_ID),
        ({"tokenizer_config.json": {"eos_token": IM_END},
          "tokenizer.json": {"added_tokens": [], "model": None}}, NO_ID),
    ],
)  # fmt: skip
def test_unreadable_tokenizer_files_are_logged_not_refused(
    tmp_path: Path, files: dict[str, Any], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path, "config.json", {**TINY_HF_CONFIG, "eos_token_id": 2})
    _write(tmp_path, "generation_config.json", {"eos_token_id": [7, 2]})
    for name, data in files.items():
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
    with caplog.at_level(logging.WARNING):
        config = ModelConfig.from_hf_config(tmp_path)
    assert message in caplog.text
    assert (config.eos_token_ids, config.eos_stop_token_ids) == ((2, 7), (7,))


def test_a_checkpoint_without_tokenizer_files_logs_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Naming no tokenizer EOS is normal (a bare checkpoint), not worth a warning.
    Mutant (s32): a missing `eos_token` warned "eos_token is null, not a token"."""
    _write(tmp_path, "config.json", {**TINY_HF_CONFIG, "eos_token_id": 2})
    _write(tmp_path, "tokenizer_config.json", {"model_max_length": 8})
    with caplog.at_level(logging.WARNING):
        assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == (2,)
    assert caplog.records == []


def test_a_hand_built_model_config_checks_its_eos_stop_token_ids() -> None:
    with pytest.raises(ValueError, match=r"eos_stop_token_ids must be a tuple of some of"):
        ModelConfig(**{**_tiny_fields(), "eos_token_ids": (2,), "eos_stop_token_ids": (3,)})


def _tiny_fields() -> dict[str, Any]:
    tiny = ModelConfig.tiny()
    return {name: getattr(tiny, name) for name in tiny.__dataclass_fields__}


def _checkpoint(path: Path) -> list[int]:
    """Save a tiny checkpoint with no EOS at `path`; return its greedy tokens."""
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"))
    _write(path, "config.json", {**TINY_HF_CONFIG, "eos_token_id": None})
    (out,) = _run(path, SamplingParams(max_tokens=8))
    tokens = list(out.output_token_ids)
    assert len(set(tokens[:3])) == 3, tokens
    return tokens


def _run(path: Path, params: SamplingParams) -> list[Any]:
    with LLM(model=path, engine=EngineConfig(num_gpu_blocks=32)) as llm:
        return llm.generate([PROMPT], params)


def test_the_generation_configs_extra_eos_is_the_stop_reason(tmp_path: Path) -> None:
    tokens = _checkpoint(tmp_path)
    # The tokenizer's EOS is the second token, the generation config's other one the first.
    _write(tmp_path, "generation_config.json", {"eos_token_id": [tokens[1], tokens[0]]})
    _write(tmp_path, "tokenizer_config.json", _tokenizer_config(tokens[1]))
    (out,) = _run(tmp_path, SamplingParams(max_tokens=8))
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (tokens[:1], tokens[0])
    assert out.finish_reason == "stop"
    _write(tmp_path, "generation_config.json", {"eos_token_id": [tokens[1]]})
    (out,) = _run(tmp_path, SamplingParams(max_tokens=8))
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (tokens[:2], None)
    # With ignore_eos, neither stops it; a request's own stop id still names itself.
    (out,) = _run(tmp_path, SamplingParams(max_tokens=8, ignore_eos=True))
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (tokens, None)
    both = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[tokens[1]])
    (out,) = _run(tmp_path, both)
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (tokens[:2], tokens[1])


def test_a_tokenizer_eos_named_in_no_config_stops_generation(tmp_path: Path) -> None:
    tokens = _checkpoint(tmp_path)
    _write(tmp_path, "tokenizer_config.json", _tokenizer_config(tokens[2]))
    (out,) = _run(tmp_path, SamplingParams(max_tokens=8))
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (tokens[:3], None)
    assert out.finish_reason == "stop"
