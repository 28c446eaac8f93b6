"""The tokenizer's EOS token id of a local HF checkpoint, read without a tokenizer.

vLLM stops a request at its tokenizer's `eos_token_id` with no `stop_reason`, and takes
a `generation_config.json`'s other EOS ids as stop token ids, reported as the
`stop_reason` (`SamplingParams.update_from_generation_config`). The reference engine
has no tokenizer, so it reads the id from the files transformers reads it from:
`tokenizer_config.json`'s `eos_token` (a str or `{"content": str}`; a legacy
`special_tokens_map.json`'s wins where `tokenizer_config.json` has no
`added_tokens_decoder`, even a null one, as transformers 5 reads them), looked up in its
`added_tokens_decoder`, then in `tokenizer.json`'s `added_tokens` and `model.vocab`
(a dict, or a Unigram model's list of `[piece, score]` pairs).
The files only name which id vLLM treats as the EOS: one that is missing or malformed
is logged and left out (None), never a reason to refuse the checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


def tokenizer_eos_token_id(directory: Path) -> int | None:
    """Return the id of the EOS token the tokenizer files in `directory` name, or None
    where they name none (no files, no `eos_token`, or a token they give no id)."""
    config = _json_object(directory / TOKENIZER_CONFIG_FILE) or {}
    eos, source = config.get("eos_token"), TOKENIZER_CONFIG_FILE
    if "added_tokens_decoder" not in config:  # transformers' legacy path: the map wins
        special = _json_object(directory / SPECIAL_TOKENS_MAP_FILE)
        if special is not None and "eos_token" in special:  # a null one too: no EOS
            eos, source = special["eos_token"], SPECIAL_TOKENS_MAP_FILE
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        return None
    if not isinstance(eos, str):
        logger.warning(
            "%s: eos_token is %s, not a token: the tokenizer's EOS is not known",
            directory / source,
            json.dumps(eos),
        )
        return None
    found = _id_in_added_tokens_decoder(config.get("added_tokens_decoder"), eos)
    if found is None:
        found = _id_in_tokenizer_json(directory / TOKENIZER_FILE, eos)
    if found is None:
        logger.warning(
            "%s: no id found for eos_token %s: the tokenizer's EOS is not known",
            directory,
            json.dumps(eos),
        )
    return found


def _json_object(path: Path) -> dict[str, Any] | None:
    """Return the JSON object in `path`, or None (logged unless absent)."""
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        logger.warning("%s could not be read (%s): the tokenizer's EOS is not known", path, exc)
        return None
    if not isinstance(data, dict):
        logger.warning("%s is no JSON object: the tokenizer's EOS is not known", path)
        return None
    return data


def _id_in_added_tokens_decoder(decoder: object, content: str) -> int | None:
    """Return the id `tokenizer_config.json`'s `{"id": {"content": ...}}` gives `content`."""
    if not isinstance(decoder, dict):
        return None
    for key, token in decoder.items():
        if isinstance(token, dict) and token.get("content") == content and key.isdecimal():
            return int(key)
    return None


def _id_in_tokenizer_json(path: Path, content: str) -> int | None:
    """Return the id `tokenizer.json` gives `content`: an added token's, else the vocab's."""
    data = _json_object(path)
    if data is None:
        return None
    added = data.get("added_tokens")
    for token in added if isinstance(added, list) else ():
        if isinstance(token, dict) and token.get("content") == content:
            token_id = token.get("id")
            return token_id if type(token_id) is int and token_id >= 0 else None
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the index
        return _id_in_unigram_vocab(vocab, content)
    token_id = vocab.get(content) if isinstance(vocab, dict) else None
    return token_id if type(token_id) is int and token_id >= 0 else None


def _id_in_unigram_vocab(vocab: list[Any], content: str) -> int | None:
    """Return the index of `content`'s last `[piece, score]` pair (tokenizers maps a
    piece listed twice to its last id), or None."""
    found = None
    for index, entry in enumerate(vocab):
        if isinstance(entry, list) and entry and entry[0] == content:
            found = index
    return found
