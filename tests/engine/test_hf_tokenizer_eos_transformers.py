"""The tokenizer's EOS id as transformers' AutoTokenizer reads it from a checkpoint's
tokenizer files (hard-coded, and cross-checked where transformers is installed).

Regression (s32 mutation run, mutant T02 matched transformers where the code did not):
a legacy `special_tokens_map.json` holding `"eos_token": null` (and a tokenizer_config.json
with no added_tokens_decoder) gives transformers 5 no EOS at all, but the engine kept
tokenizer_config.json's `eos_token`, so it stopped generation at a token vLLM does not
stop at (and reported other EOS ids' stop_reason differently).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.hf_tokenizer_eos import tokenizer_eos_token_id

VOCAB = {"a": 0, "b": 1, "</s>": 2, "<|im_end|>": 3}
TOKENIZER_JSON = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": VOCAB, "unk_token": "a"},
}
TOKENIZER_CONFIG = {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
# special_tokens_map.json (None: no such file) -> the EOS id transformers 5.20 / 5.25 give.
CASES: dict[str, tuple[dict[str, Any] | None, int | None]] = {
    "no map": (None, 2),
    "map without eos_token": ({}, 2),
    "map naming another eos": ({"eos_token": "<|im_end|>"}, 3),
    "map with a null eos_token": ({"eos_token": None}, None),
}


def _write(path: Path, special_map: dict[str, Any] | None) -> Path:
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER_JSON))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    return path


@pytest.mark.parametrize("case", CASES)
def test_the_eos_id_is_the_one_transformers_reads(tmp_path: Path, case: str) -> None:
    special_map, expected = CASES[case]
    assert tokenizer_eos_token_id(_write(tmp_path, special_map)) == expected


@pytest.mark.parametrize("case", CASES)
def test_the_eos_id_matches_auto_tokenizer(tmp_path: Path, case: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _write(tmp_path, CASES[case][0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    assert tokenizer_eos_token_id(path) == tokenizer.eos_token_id


# A Unigram model (SentencePiece-converted checkpoints: T5, Llama-1's converted
# tokenizers) lists its vocab as [piece, score] pairs whose index is the id; a piece
# listed twice takes its last index, as the tokenizers library builds its map.
UNIGRAM_VOCABS: dict[str, tuple[list[list[Any]], int | None]] = {
    "eos in the vocab": ([["<unk>", 0.0], ["a", -1.0], ["b", -1.5], ["</s>", 0.0]], 3),
    "eos listed twice": ([["<unk>", 0.0], ["</s>", 0.0], ["a", -1.0], ["</s>", -2.0]], 3),
    "eos first": ([["</s>", 0.0], ["<unk>", 0.0], ["a", -1.0]], 0),
}


def _write_unigram(path: Path, vocab: list[list[Any]]) -> Path:
    model = {"type": "Unigram", "unk_id": 0 if vocab[0][0] == "<unk>" else 1, "vocab": vocab}
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER_JSON | {"model": model}))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return path


@pytest.mark.parametrize("case", UNIGRAM_VOCABS)
def test_a_unigram_vocab_gives_the_eos_its_index(tmp_path: Path, case: str) -> None:
    """Regression (s33): a Unigram tokenizer.json's list vocab was never searched, so a
    checkpoint naming its EOS only there ran with no tokenizer EOS, and generation went
    on past the token vLLM stops at."""
    vocab, expected = UNIGRAM_VOCABS[case]
    assert tokenizer_eos_token_id(_write_unigram(tmp_path, vocab)) == expected


@pytest.mark.parametrize("case", UNIGRAM_VOCABS)
def test_a_unigram_eos_matches_auto_tokenizer(tmp_path: Path, case: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _write_unigram(tmp_path, UNIGRAM_VOCABS[case][0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    assert tokenizer_eos_token_id(path) == tokenizer.eos_token_id
