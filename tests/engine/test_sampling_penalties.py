"""vLLM's `repetition_penalty`, `presence_penalty`, `frequency_penalty` and `min_tokens`
change the logits as vLLM 0.33's sampler does, before temperature and the filters,
checked exactly against a plain-Python reference (logits and penalties on a binary grid,
so float32 and float64 agree bit for bit); values out of vLLM's ranges are refused by
name and value, with vLLM's messages.

Regression: `SamplingParams(repetition_penalty=1.2)` (or the other three) raised
"unexpected keyword argument", so code written for vLLM failed on the reference engine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.engine.penalties import adjusted_logits
from kvtier.engine.sampling import SamplingParams, sample

INF = math.inf
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")


def reference(
    row: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos: Sequence[int],
) -> list[float]:
    """Return vLLM's penalized logits of `row`, one token at a time: min_tokens' stop
    mask, then the repetition penalty (prompt and output), then frequency and presence
    (output only)."""
    out = list(row)
    if len(output) < params.min_tokens:
        for token in [*eos, *params.stop_token_ids]:
            out[token] = -INF
    for token in range(len(out)):
        if token in prompt or token in output:
            if out[token] > 0:
                out[token] = out[token] / params.repetition_penalty
            else:
                out[token] = out[token] * params.repetition_penalty
        count = list(output).count(token)
        out[token] -= params.frequency_penalty * count
        if count:
            out[token] -= params.presence_penalty
    return out


def without_penalties(params: SamplingParams) -> SamplingParams:
    fields = {name: getattr(params, name) for name in params.__dataclass_fields__}
    fields.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return SamplingParams(**{**fields, "min_tokens": 0})


def test_each_penalty_changes_the_logits_as_vllm() -> None:
    row = [2.0, -1.0, 0.5, 3.0, -0.25, 0.0, 1.5]
    masked = [2.0, -1.0, 0.5, -INF, -0.25, 0.0, -INF]
    prompt, output = [0, 1, 5], [1, 2, 2, 4]
    cases = {
        # seen tokens 0, 1, 2, 4, 5: positive divided, negative (and 0) multiplied
        "repetition": ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 3.0, -0.5, 0.0, 1.5]),
        # output counts: 1 once, 2 twice, 4 once; the prompt does not count
        "frequency": ({"frequency_penalty": 0.5}, [2.0, -1.5, -0.5, 3.0, -0.75, 0.0, 1.5]),
        "presence": ({"presence_penalty": -1.5}, [2.0, 0.5, 2.0, 3.0, 1.25, 0.0, 1.5]),
        # fewer output tokens than min_tokens: EOS (6) and the stop ids (3) at -inf
        "min_tokens": ({"min_tokens": 5, "stop_token_ids": [3]}, masked),
        "min_tokens reached": ({"min_tokens": 4, "stop_token_ids": [3]}, row),
    }
    for name, (fields, expected) in cases.items():
        params = SamplingParams(**fields)
        logits = torch.tensor([row])
        got = _penalized(logits, params, prompt, output, eos=[6])
        assert got == expected, name
        assert reference(row, params, prompt, output, [6]) == expected, name
        assert logits.tolist() == [row], name  # the caller's logits (raw logprobs) unchanged


def _penalized(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos: list[int],
) -> list[float]:
    """Return the row `sample` draws from (the penalized logits `sample` computes)."""
    adjusted = adjusted_logits(logits.clone(), [params], [(prompt, output)], eos)
    return [float(x) for x in adjusted[0]]


def _random_case(rng: random.Random, vocab: int) -> tuple[list[float], SamplingParams, Any]:
    row = [rng.randint(-16, 16) / 4 for _ in range(vocab)]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
    sampled = rng.random() < 0.5
    params = SamplingParams(
        max_tokens=16,
        temperature=rng.choice([0.25, 0.5, 1.0, 2.0]) if sampled else 0.0,
        seed=rng.randrange(1000) if sampled else None,
        top_k=rng.choice([0, 0, 2, 5]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        repetition_penalty=rng.choice([1.0, 0.5, 2.0, 4.0]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.25, -0.75, 1.5]),
        min_tokens=rng.choice([0, 0, 3, 9]),
        stop_token_ids=rng.sample(range(vocab), rng.randint(0, 2)),
    )
    return row, params, (prompt, output)


def test_random_cases_match_the_reference_exactly() -> None:
    rng = random.Random(0)
    vocab, eos = 12, [11]
    for case in range(200):
        row, params, (prompt, output) = _random_case(rng, vocab)
        expected = reference(row, params, prompt, output, eos)
        assert _penalized(torch.tensor([row]), params, prompt, output, eos) == expected, case


def _draw(
    rows: list[list[float]],
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]] | None,
    eos: list[int],
) -> list[int]:
    generators = [p.make_generator(torch.Generator().manual_seed(7)) for p in params]
    return sample(torch.tensor(rows), params, generators, histories, eos)


def test_penalties_come_before_temperature_and_the_filters() -> None:
    """Sampling a row with penalties draws as sampling its reference-penalized row
    without them, seed for seed: the penalties are applied first."""
    rng = random.Random(1)
    vocab, eos = 12, [11]
    for case in range(200):
        row, params, (prompt, output) = _random_case(rng, vocab)
        expected_row = reference(row, params, prompt, output, eos)
        if all(x == -INF for x in expected_row):
            continue
        plain = without_penalties(params)
        expected = _draw([expected_row], [plain], None, eos)
        assert _draw([row], [params], [(prompt, output)], eos) == expected, case


def test_presence_before_temperature_changes_what_top_p_keeps() -> None:
    """(1 - 0.75) / 0.25 against 0 keeps both tokens under top_p 0.9 (p = 0.73, 0.27);
    a penalty after temperature (4 - 0.75 against 0: p = 0.96) would keep token 0 only."""
    params = SamplingParams(temperature=0.25, top_p=0.9, presence_penalty=0.75)
    drawn = []
    for seed in range(100):
        generator = torch.Generator().manual_seed(seed)
        drawn += sample(torch.tensor([[1.0, 0.0]]), [params], [generator], [([1], [0])])
    assert 10 < drawn.count(1) < 50


def test_a_penalty_decides_what_top_k_keeps() -> None:
    """Token 0 leads before the penalty; top_k=1 then keeps token 1 for every seed."""
    params = SamplingParams(temperature=1.0, top_k=1, repetition_penalty=2.0)
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert sample(torch.tensor([[2.0, 1.5, 0.0]]), [params], [generator], [([0], [])]) == [1]


def test_a_batch_with_different_penalties_samples_each_row_as_alone() -> None:
    rng = random.Random(2)
    vocab, eos = 12, [11]
    cases = [_random_case(rng, vocab) for _ in range(24)]
    rows = [row for row, _, _ in cases]
    params = [p for _, p, _ in cases]
    histories = [history for _, _, history in cases]
    batched = _draw(rows, params, histories, eos)
    alone = [_draw([r], [p], [h], eos)[0] for r, p, h in zip(rows, params, histories, strict=True)]
    assert batched == alone
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert greedy  # and their tokens are the reference rows' argmax
    for i in greedy:
        expected_row = reference(rows[i], params[i], *histories[i], eos)
        assert batched[i] == max(range(vocab), key=lambda t: (expected_row[t], -t))


def test_min_tokens_masks_eos_even_with_ignore_eos_as_vllm() -> None:
    """vLLM's `all_stop_token_ids` holds the EOS ids whatever `ignore_eos` says."""
    params = SamplingParams(min_tokens=2, ignore_eos=True)
    assert sample(torch.tensor([[0.0, 5.0, 1.0]]), [params], [None], [([0], [2])], [1]) == [2]
    assert sample(torch.tensor([[0.0, 5.0, 1.0]]), [params], [None], [([0], [2, 2])], [1]) == [1]


def test_repetition_penalty_divides_positive_logits_as_vllms_cuda_kernel() -> None:
    """vLLM's CUDA kernel (`apply_repetition_penalties_`) divides a seen token's positive
    logit by the float32 penalty; its CPU fallback multiplies by 1/penalty instead, one
    float32 bit apart on some values. The engine follows the kernel vLLM serves with."""
    penalty = np.float32(1.3)
    logits = np.array([4.125, 4.875, -4.125, 1.0], dtype=np.float32)
    divided = [logits[0] / penalty, logits[1] / penalty, logits[2] * penalty, logits[3]]
    reciprocal = [logits[0] * (np.float32(1) / penalty), logits[1] * (np.float32(1) / penalty)]
    assert [divided[0], divided[1]] == [np.float32(3.173077), np.float32(3.7500002)]
    assert reciprocal == [np.float32(3.1730769), np.float32(3.75)]  # the CPU fallback's
    params = SamplingParams(repetition_penalty=1.3)
    out = adjusted_logits(torch.from_numpy(logits).unsqueeze(0), [params], [([0, 1], [2])], ())
    assert out[0].tolist() == [float(value) for value in divided]


def test_penalties_without_histories_are_refused() -> None:
    with pytest.raises(ValueError, match=r"need each request's prompt and output token ids"):
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [None])
    # One history for two requests: named as such (mutation: a bare zip() length error).
    two = [SamplingParams(presence_penalty=1.0)] * 2
    with pytest.raises(ValueError, match=r"\(histories\): got 1 for 2 requests"):
        sample(torch.zeros(2, 4), two, [None, None], [([0], [1])])


def test_penalties_change_a_copy_the_raw_logits_stay() -> None:
    """The raw logits give the logprobs (vLLM's default `logprobs_mode`): sampling with
    penalties leaves the caller's float32 CPU tensor alone. Mutation: adjusting the rows
    in place (no clone) penalized them."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    raw = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, min_tokens=1)
    sample(logits, [params], [None], [([1], [1, 2])], [3])
    assert torch.equal(logits, raw)


def test_min_tokens_skips_eos_ids_outside_the_vocab() -> None:
    """An EOS id the logits have no column for masks nothing (mutation: it was indexed,
    an IndexError inside the step); the stop id inside the vocab is still masked."""
    params = SamplingParams(min_tokens=2, stop_token_ids=[1])
    assert sample(torch.tensor([[0.0, 5.0, 1.0]]), [params], [None], [([0], [])], [3, 7]) == [2]


def test_the_range_ends_are_taken_as_in_vllm() -> None:
    """vLLM's ranges are closed: -2 and 2 penalties, `min_tokens` equal to `max_tokens`.
    Mutations: an open -2 end refused -2.0; `min_tokens >= max_tokens` refused 16."""
    for value in (-2.0, 2.0, -2):
        params = SamplingParams(presence_penalty=value, frequency_penalty=value)
        assert (params.presence_penalty, params.frequency_penalty) == (value, value)
    assert SamplingParams(max_tokens=16, min_tokens=16).min_tokens == 16


def test_neutral_values_leave_the_logits_alone() -> None:
    params = SamplingParams(repetition_penalty=1, presence_penalty=0, frequency_penalty=0)
    assert params == SamplingParams()
    assert not params.adjusts_logits
    assert (params.repetition_penalty, params.presence_penalty) == (1.0, 0.0)
    assert isinstance(params.repetition_penalty, float)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=2)
    assert (greedy.repetition_penalty, greedy.min_tokens) == (1.5, 2)  # kept when greedy


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, ValueError, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"frequency_penalty": math.nan}, ValueError, r"frequency_penalty must be in .*got nan"),
        ({"presence_penalty": "1"}, TypeError, r"presence_penalty must be a float .*got '1'"),
        ({"repetition_penalty": 0}, ValueError, r"repetition_penalty must be greater than zero"),
        ({"repetition_penalty": math.inf}, ValueError, r"must be a finite number, got inf"),
        ({"repetition_penalty": None}, TypeError, r"repetition_penalty must be a float"),
        ({"min_tokens": -1}, ValueError, r"min_tokens must be greater than or equal to 0, got -1"),
        ({"min_tokens": 17}, ValueError, r"less than or equal to max_tokens=16, got 17"),
        ({"min_tokens": 2.0}, TypeError, r"min_tokens must be an int >= 0, got 2.0"),
        ({"min_tokens": True}, TypeError, r"min_tokens must be an int >= 0, got True"),
    ],
)
def test_values_out_of_vllms_ranges_are_refused_by_value(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**fields)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
