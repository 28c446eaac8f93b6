"""Stop and EOS token ids outside the model's vocab are refused or named, not kept.

Regression: `SamplingParams(stop_token_ids=(128,))` on a 128-token model, or a
`ModelConfig` with `eos_token_ids=(128,)`, was accepted; the model can never sample
such an id, so it never stopped anything (a typo ran every request to `max_tokens`).
vLLM 0.33 refuses out-of-vocab stop ids when a request is added, naming them and the
vocab size; it takes a checkpoint's EOS ids as they are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from engine_helpers import TINY_HF_CONFIG

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PROMPT = [3, 1, 4, 1, 5]


def _llm() -> LLM:
    return LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=16))


@pytest.mark.parametrize("stop", [(128,), (5, 128, 1000)])
def test_generate_refuses_stop_ids_outside_the_vocab(stop: tuple[int, ...]) -> None:
    llm = _llm()
    params = SamplingParams(max_tokens=4, stop_token_ids=stop)
    beyond = [t for t in stop if t >= 128]
    message = (
        rf"prompt 1: stop_token_ids \[{', '.join(map(str, beyond))}\] outside the vocab \[0, 128\)"
    )
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), params])
    with pytest.raises(ValueError, match=r"request req-0: stop_token_ids \[.*\] outside the vocab"):
        llm.add_request(PROMPT, params)
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()


def test_the_last_id_of_the_vocab_may_be_a_stop_id() -> None:
    (out,) = _llm().generate([PROMPT], SamplingParams(max_tokens=2, stop_token_ids=(127,)))
    assert len(out.output_token_ids) >= 1


def test_a_model_config_refuses_eos_ids_outside_the_vocab() -> None:
    with pytest.raises(ValueError, match=r"eos_token_ids \[128\] outside the vocab \[0, 128\)"):
        dataclasses.replace(ModelConfig.tiny(), eos_token_ids=(2, 128))
    assert dataclasses.replace(ModelConfig.tiny(), eos_token_ids=(127,)).eos_token_ids == (127,)


def test_a_checkpoints_eos_ids_outside_the_vocab_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM, such a checkpoint (e.g. its vocab cut down) still loads; the ids are
    named in a warning instead of being kept where they could never match."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "eos_token_id": [2, 300]}))
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": [128, 7]}))
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.hf_config"):
        config = ModelConfig.from_hf_config(tmp_path)
    assert config.eos_token_ids == (2, 7)
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"{tmp_path / 'config.json'}: eos_token_id [300] outside" in m for m in messages)
    assert any(
        f"{generation}: eos_token_id [128] outside the vocab [0, 128)" in m for m in messages
    )
