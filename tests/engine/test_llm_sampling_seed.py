"""`EngineConfig.seed` seeds the temperature sampling of requests without a seed.

Regression: an unseeded request's generator was seeded from torch's global RNG, so two
engines with the same seed given the same calls sampled differently (the global RNG had
moved on), a `torch.manual_seed` elsewhere in the program changed the engine's tokens,
and every unseeded request advanced the global RNG under its other users. In vLLM the
engine's `seed` makes such runs repeat.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import TINY_HF_CONFIG
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.model import build_model
from kvtier.engine.sampling import SamplingParams

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [3, 5, 8, 9, 7, 9]]
HOT = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)


def _engine(seed: int, model: Path | None = None) -> LLM:
    return LLM(model=model, engine=EngineConfig(num_gpu_blocks=64, seed=seed))


def _tokens(llm: LLM, prompts: list[list[int]], params: object = HOT) -> list[tuple[int, ...]]:
    return [out.output_token_ids for out in llm.generate(prompts, params)]  # type: ignore[arg-type]


def _two_calls(seed: int, model: Path | None = None) -> list[list[tuple[int, ...]]]:
    with _engine(seed, model) as llm:
        first = _tokens(llm, PROMPTS)
        torch.rand(1000)  # other users of the global RNG between the calls
        return [first, _tokens(llm, PROMPTS[:2])]


def test_the_same_engine_seed_samples_the_same_whatever_the_global_rng() -> None:
    with torch.random.fork_rng(devices=[]):  # the seeds stay in this test
        torch.manual_seed(1)
        first = _two_calls(seed=5)
        torch.manual_seed(2)
        assert _two_calls(seed=5) == first


def test_unseeded_sampling_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    with _engine(seed=5) as llm:
        _tokens(llm, PROMPTS)
        request = llm.add_request(PROMPTS[0], HOT)
        while not llm.step():
            pass
    assert request.finish_reason is not None
    assert torch.equal(torch.get_rng_state(), state)


def _checkpoint(path: Path) -> Path:
    """Write a tiny checkpoint: the weights then do not depend on the engine seed."""
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {f"model.{name}": p.detach().clone() for name, p in model.named_parameters()}
    tensors["lm_head.weight"] = tensors.pop("model.lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    return path


def test_different_engine_seeds_sample_differently_with_the_same_weights(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    assert _two_calls(seed=5, model=path) == _two_calls(seed=5, model=path)
    assert _two_calls(seed=5, model=path) != _two_calls(seed=6, model=path)
    with _engine(seed=5, model=path) as llm:
        greedy = _tokens(llm, PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    with _engine(seed=6, model=path) as llm:
        assert _tokens(llm, PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True)) == greedy


def test_unseeded_requests_are_seeded_in_arrival_order_whatever_the_batch() -> None:
    with _engine(seed=5) as llm:
        together = _tokens(llm, PROMPTS)
    with _engine(seed=5) as llm:
        # One call per prompt, with greedy, seeded and refused requests (no draw) between.
        with pytest.raises(ValueError, match="outside the vocab"):
            llm.generate([PROMPTS[0], [1000]], HOT)
        apart = []
        for prompt in PROMPTS:
            _tokens(llm, [prompt], SamplingParams(max_tokens=2))
            _tokens(llm, [prompt], SamplingParams(max_tokens=2, temperature=1.0, seed=9))
            apart += _tokens(llm, [prompt])
    assert apart == together
    with _engine(seed=5) as llm:
        requests = [llm.add_request(prompt, HOT) for prompt in PROMPTS]
        while any(r.finish_reason is None for r in requests):
            llm.step()
    assert [tuple(r.output_token_ids) for r in requests] == together


def test_a_seeded_request_samples_the_same_whatever_the_engine_seed_and_batch(
    tmp_path: Path,
) -> None:
    path = _checkpoint(tmp_path)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    with _engine(seed=5, model=path) as llm:
        (alone,) = _tokens(llm, PROMPTS[:1], seeded)
    with _engine(seed=6, model=path) as llm:
        _tokens(llm, PROMPTS)
        batched = _tokens(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [HOT, seeded, HOT])
    assert batched[1] == alone
