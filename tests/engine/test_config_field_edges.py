"""ModelConfig, CacheConfig and EngineConfig at their edges, each refusal naming the
field (s33 mutation run on `engine/config.py`: each case passed every older test)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.engine.config import AttentionKind, CacheConfig, EngineConfig, ModelConfig

FULL = AttentionKind.FULL


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_position": 0}, r"ModelConfig.max_position must be a positive int, got 0"),
        ({"hidden_size": True}, r"ModelConfig.hidden_size must be a positive int, got True"),
        ({"layer_kinds": (FULL,) * 3}, r"layer_kinds has 3 entries for num_layers=2"),
        ({"layer_kinds": (FULL, "full")}, r"layer_kinds must hold AttentionKind values"),
        ({"eos_token_ids": (2.0,)}, r"eos_token_ids must be a tuple of token ids .*got \(2.0,\)"),
        ({"eos_token_ids": (True,)}, r"eos_token_ids must be a tuple of token ids .*got \(True,\)"),
        ({"eos_token_ids": (128,)}, r"eos_token_ids \[128\] outside the vocab \[0, 128\)"),
        ({"dtype": torch.int64}, r"ModelConfig.dtype must be a floating point torch.dtype"),
    ],
)
def test_a_model_config_value_that_would_change_the_model_is_refused(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.tiny(), **changes)


def test_the_last_token_of_the_vocab_may_be_an_eos() -> None:
    assert dataclasses.replace(ModelConfig.tiny(), eos_token_ids=(127,)).eos_token_ids == (127,)


@pytest.mark.parametrize("name", ["block_size", "num_blocks"])
def test_a_bool_cache_size_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"CacheConfig.{name} must be a positive int, got True"):
        CacheConfig(**{name: True})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seed": True}, r"EngineConfig.seed must be an int, got True"),
        ({"max_logprobs": False}, r"EngineConfig.max_logprobs must be an int, got False"),
    ],
)
def test_a_bool_seed_or_logprobs_cap_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        EngineConfig(**changes)


def test_a_numpy_logprobs_cap_is_stored_as_a_python_int() -> None:
    config = EngineConfig(max_logprobs=np.int64(5))  # type: ignore[arg-type]
    assert config.max_logprobs == 5
    assert type(config.max_logprobs) is int
