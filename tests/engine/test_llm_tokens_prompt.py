"""`generate` and `add_request` take vLLM's `TokensPrompt` dicts, `{"prompt_token_ids": ids}`,
for token id lists (a text `"prompt"` beside the ids, and None values, as vLLM does), and
refuse by name the dict keys the engine cannot honour.

Regression: code written for vLLM's `LLM.generate({"prompt_token_ids": ids})` (or a list of
such dicts) was refused as "must be a sequence of token ids".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0)


def small_llm() -> LLM:
    return LLM(None, engine=EngineConfig(block_size=4, num_gpu_blocks=9))


def results(prompts: Any, params: SamplingParams) -> list[tuple[tuple[int, ...], ...]]:
    """Return each output's prompt and output token ids, from a fresh engine."""
    outputs = small_llm().generate(prompts, params)
    return [(out.prompt_token_ids, out.output_token_ids) for out in outputs]


@pytest.mark.parametrize("params", [PARAMS, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    ("prompts", "plain"),
    [
        ({"prompt_token_ids": [1, 2, 3]}, [[1, 2, 3]]),
        ([{"prompt_token_ids": [1, 2, 3]}], [[1, 2, 3]]),
        ([{"prompt_token_ids": p} for p in PROMPTS], PROMPTS),
        ([[1, 2, 3], {"prompt_token_ids": [4, 5]}], PROMPTS),
        ([{"prompt_token_ids": (1, 2, 3)}, {"prompt_token_ids": np.array([4, 5])}], PROMPTS),
    ],
    ids=["one-dict", "list-of-one", "list-of-dicts", "mixed", "tuple-and-array"],
)
def test_tokens_prompts_run_as_their_token_lists(
    prompts: Any, plain: list[list[int]], params: SamplingParams
) -> None:
    expected = results(plain, params)
    assert [p for p, _ in expected] == [list(p) for p in plain]
    assert results(prompts, params) == expected


def test_add_request_takes_a_tokens_prompt() -> None:
    finished = []
    for prompt in ([1, 2, 3], {"prompt_token_ids": [1, 2, 3]}):
        llm = small_llm()
        request = llm.add_request(prompt, SAMPLED)
        while request not in llm.step():
            pass
        finished.append((tuple(request.prompt_token_ids), tuple(request.output_token_ids)))
    assert finished[0] == finished[1]
    assert len(finished[0][1]) == 3


@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt_token_ids": [1, 2, 3], "prompt": "a b c"},
        {"prompt_token_ids": [1, 2, 3], "multi_modal_data": None, "cache_salt": None},
        {"prompt": "a b c", "prompt_token_ids": [1, 2, 3], "mm_processor_kwargs": None},
        {
            "prompt_token_ids": [1, 2, 3],
            "prompt": "",
            "multi_modal_data": {},
            "mm_processor_kwargs": {},
            "multi_modal_uuids": {},
            "cache_salt": "",
            "token_type_ids": [],
        },
    ],
    ids=["text-beside-ids", "none-values", "text-and-none", "empty-values"],
)
def test_text_beside_the_ids_and_none_values_run_as_the_ids(prompt: dict[str, Any]) -> None:
    """Regression: refused by key, where vLLM 0.33 runs the ids (a `TokensPrompt`'s text
    is not tokenized, only carried) and reads a None value as no value, and an empty one
    too (`multi_modal_data: {}`: its `if data := prompt.get(key)` tests skip it)."""
    expected = results([[1, 2, 3]], SAMPLED)
    assert results([prompt], SAMPLED) == expected
    assert results(prompt, SAMPLED) == expected
    llm = small_llm()
    request = llm.add_request(prompt, SAMPLED)
    while request not in llm.step():
        pass
    assert [(request.prompt_token_ids, tuple(request.output_token_ids))] == expected


@pytest.mark.parametrize(
    ("prompt", "text"),
    [
        ({"prompt_token_ids": [1, 2, 3], "prompt": "a b c"}, "a b c"),
        ({"prompt_token_ids": [1, 2, 3], "prompt": ""}, None),
        ({"prompt_token_ids": [1, 2, 3], "prompt": None}, None),
        ({"prompt_token_ids": [1, 2, 3]}, None),
        ([1, 2, 3], None),
    ],
    ids=["text", "empty-text", "none-text", "no-text", "list"],
)
def test_a_tokens_prompts_text_is_carried_to_its_output(prompt: Any, text: str | None) -> None:
    """Regression: a `TokensPrompt`'s text was dropped (`RequestOutput` had no `prompt`),
    where vLLM 0.33 carries it to `RequestOutput.prompt` (None when absent or empty)."""
    llm = small_llm()
    (output,) = llm.generate([prompt], PARAMS)
    assert output.prompt == text
    assert [out.prompt for out in llm.generate([prompt, [4, 5], prompt], PARAMS)] == [
        text,
        None,
        text,
    ]
    request = llm.add_request(prompt, PARAMS)
    assert request.prompt == text


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "hello"}, " has key 'prompt' \\(text\\), which the reference engine does not"),
        ({"prompt": "a b", "prompt_token_ids": None}, " has key 'prompt' \\(text\\), which"),
        ({"prompt_token_ids": None}, "'s 'prompt_token_ids' is None: give the prompt's token"),
        ({"multi_modal_data": None}, " has no 'prompt_token_ids': give the prompt's token ids"),
        ({"prompt_token_ids": [1], "prompt": 5}, r"'s 'prompt' must be the text .* got 5 \(int\)"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": 0}}, " has key 'multi_modal"),
        ({"prompt_token_ids": [1, 2], "cache_salt": "s"}, " has key 'cache_salt',"),
        (
            {"prompt_token_ids": [1], "mm_processor_kwargs": {"a": 1}, "token_type_ids": [0]},
            " has keys 'mm_processor_kwargs', 'token_type_ids',",
        ),
        ({"prompt_embeds": [[0.5]]}, " has key 'prompt_embeds',"),
        ({}, " is an empty dict: give its token ids as 'prompt_token_ids'"),
        ({"prompt_token_ids": "abc"}, "'s 'prompt_token_ids' is a str: the engine takes token ids"),
        ({"prompt_token_ids": [1, 2.5]}, "'s 'prompt_token_ids': token 1 is 2.5, not an int"),
    ],
    ids=[
        "text",
        "text-beside-none-ids",
        "none-ids",
        "only-none",
        "int-text",
        "multi-modal",
        "salt",
        "two-keys",
        "embeds",
        "empty",
        "str-ids",
        "float-id",
    ],
)
def test_prompt_dicts_the_engine_cannot_honour_are_refused(prompt: Any, message: str) -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match="prompt 1" + message):
        llm.generate([[1, 2, 3], prompt], PARAMS)
    with pytest.raises(TypeError, match="request req-0" + message):
        llm.add_request(prompt, PARAMS)
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()


def test_the_refusal_says_the_engine_has_no_tokenizer() -> None:
    with pytest.raises(TypeError, match=r"it has no tokenizer and takes only 'prompt_token_ids'$"):
        small_llm().generate({"prompt": "hello"}, PARAMS)


def test_empty_token_ids_in_a_dict_are_an_empty_prompt() -> None:
    """Empty token ids are the prompt's, not a missing value: refused as an empty prompt,
    as a bare empty list is. Mutation: read as no value, they were refused as "'prompt_token_ids'
    is None", naming a value the caller never gave."""
    llm = small_llm()
    with pytest.raises(ValueError, match=r"^prompt 1: empty prompt$"):
        llm.generate([[1, 2, 3], {"prompt_token_ids": []}], PARAMS)
    assert llm.stats.num_steps == 0
