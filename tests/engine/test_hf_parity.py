"""Logits of checkpoints loaded by `weights` match transformers' own forward pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import TINY_HF_CONFIG, shuffled_tables, step

from kvtier.engine.config import AttentionKind, CacheConfig
from kvtier.engine.runner import BatchInput, LogitsSelection, ModelRunner
from kvtier.engine.weights import INDEX_FILE, load_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
SHAPE = {  # ModelConfig.tiny()'s shape; head_dim and biases are passed where it is built
    **{k: v for k, v in TINY_HF_CONFIG.items() if k not in ("architectures", "head_dim")},
    "initializer_range": 0.1,  # larger than the default, so differences would show
}


def _with_random_biases(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # transformers zero-initialises biases; make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def _save_llama(path: Path) -> torch.nn.Module:
    config = transformers.LlamaConfig(**SHAPE, head_dim=16, attention_bias=True)
    model = _with_random_biases(transformers.LlamaForCausalLM(config))
    model.save_pretrained(path, max_shard_size="40KB")  # several shards and an index
    assert (path / INDEX_FILE).exists()
    return model


def _save_qwen2(path: Path) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        **SHAPE,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,  # layer 0 full, layer 1 sliding
        tie_word_embeddings=True,
    )
    model = _with_random_biases(transformers.Qwen2ForCausalLM(config))
    model.save_pretrained(path)
    return model


SAVERS = {"llama": _save_llama, "qwen2": _save_qwen2}


def _hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", SAVERS)
def test_prefill_and_paged_decode_match_transformers(arch: str, tmp_path: Path) -> None:
    with torch.random.fork_rng(devices=[]):  # seed it for this model only, not later tests
        torch.manual_seed(0)  # transformers initialises from the global RNG
        SAVERS[arch](tmp_path)
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _hf_logits(tmp_path, tokens)

    runner = ModelRunner(load_model(tmp_path), CacheConfig(block_size=4, num_blocks=32))
    if arch == "qwen2":
        kinds = runner.config.layer_kinds
        assert kinds == (AttentionKind.FULL, AttentionKind.SLIDING)
        assert runner.model.lm_head is None
    tables = shuffled_tables(runner, [len(tokens)], torch.Generator().manual_seed(2))[0]
    prefill = runner.run(BatchInput((step(tokens[:16], 0, tables),)), LogitsSelection.ALL)
    assert (prefill - expected[:16]).abs().max() <= TOLERANCE
    for pos in range(16, len(tokens)):
        logits = runner.run(BatchInput((step(tokens[pos : pos + 1], pos, tables),)))
        assert (logits[0] - expected[pos]).abs().max() <= TOLERANCE
