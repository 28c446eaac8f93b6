"""`SamplingParams` takes vLLM's `n`, `detokenize`, `skip_special_tokens` and `stop` at the
values the reference
engine honours, refusing others by value and saying what to do instead, and `logprobs` as
vLLM does (what they return: test_llm_vllm_logprobs).

Regression: code written for vLLM failed on `SamplingParams(n=1)`, `(detokenize=False)`,
`(stop=None)` or `(logprobs=5)` with "unexpected keyword argument", and `n=4` or stop
strings did not say what the engine lacks.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def tokens(params: SamplingParams) -> tuple[int, ...]:
    llm = LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=16))
    (out,) = llm.generate([PROMPT], params)
    return out.output_token_ids


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1},
        {"logprobs": 3},
        {"detokenize": False},
        {"skip_special_tokens": True},
        {"stop": None},
        {"stop": []},
    ],
    ids=["n", "logprobs", "detokenize", "skip-special", "stop-none", "stop-empty"],
)
def test_vllm_fields_at_values_the_engine_honours_run_unchanged(fields: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, **fields)
    assert params.stop == ()
    assert params.n == 1
    assert tokens(params) == tokens(SamplingParams(max_tokens=6, ignore_eos=True))


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"n": 2}, ValueError, r"n=2: the reference engine makes one completion per prompt"),
        ({"n": 0}, ValueError, r"n must be at least 1, got 0"),
        ({"n": 1.0}, TypeError, r"n must be an int, got 1.0"),
        ({"logprobs": -2}, ValueError, r"logprobs must be non-negative or -1, got -2"),
        ({"logprobs": 1.5}, TypeError, r"logprobs must be an int or None, got 1.5"),
        ({"detokenize": "no"}, TypeError, r"detokenize must be a bool, got 'no'"),
        # No text to keep them in: refused, not silently ignored (token_ids hold them).
        (
            {"skip_special_tokens": False},
            ValueError,
            r"skip_special_tokens=False: the reference engine has no tokenizer .* token_ids",
        ),
        ({"skip_special_tokens": 0}, TypeError, r"skip_special_tokens must be a bool, got 0"),
        ({"stop": "\n"}, ValueError, r"stop='\\n': stop strings need a tokenizer, .* stop_token_"),
        ({"stop": ["a", "b"]}, ValueError, r"stop=\['a', 'b'\]: stop strings need a tokenizer"),
        ({"stop": [3]}, TypeError, r"stop must be a str, a list of str or None, got \[3\]"),
        # None is taken, as vLLM's: up to the model's length (test_llm_max_model_len.py).
        ({"max_tokens": "8"}, TypeError, r"got '8' \(or None: up to the model's length\)$"),
    ],
)
def test_vllm_fields_at_other_values_are_refused_by_value(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


def test_logprobs_true_is_one_as_in_vllm() -> None:
    """Mutation: without turning True into 1, `logprobs=True` was refused as 'logprobs must
    be an int or None, got True', where vLLM takes it as 1."""
    params = SamplingParams(logprobs=True)
    assert params.logprobs == 1
    assert type(params.logprobs) is int
    assert params == SamplingParams(logprobs=1)
