"""The warning that discards a persistent tier names what changed (storage/fingerprint_diff.py).

Regression (review): the message showed the first 80 characters of both fingerprints,
which for the reference engine's JSON were the same, so a changed dtype read
`fingerprint '{"hash":[...' differs from '{"hash":[...'`.
"""

from __future__ import annotations

import json

from kvtier.storage.fingerprint_diff import describe_difference


def fingerprint(**changes: object) -> str:
    document = {"hash": ["sha256", 4, "ab" * 16], "model": {"dtype": "torch.float32"}}
    document.update(changes)
    return json.dumps(document, sort_keys=True)


def test_a_changed_value_is_named_by_its_path() -> None:
    message = describe_difference(
        fingerprint(), fingerprint(model={"dtype": "torch.bfloat16"}, device="cuda")
    )
    assert message == (
        "fingerprint changed (stored -> this engine): device: null -> 'cuda'; "
        "model.dtype: 'torch.float32' -> 'torch.bfloat16'"
    )


def test_list_items_are_named_by_index_and_numbers_are_not_quoted() -> None:
    message = describe_difference(
        fingerprint(files=[["a", 10, 7]]), fingerprint(files=[["a", 10, 8]])
    )
    assert message.endswith("files.0.2: 7 -> 8")


def test_many_differences_are_counted_past_the_first_four() -> None:
    stored = json.dumps({f"k{i}": i for i in range(6)})
    current = json.dumps({f"k{i}": i + 1 for i in range(6)})
    message = describe_difference(stored, current)
    assert message.count(" -> ") == 1 + 4  # the heading's and four differences
    assert message.endswith("; and 2 more")


def test_text_that_is_not_a_json_object_is_shown_shortened() -> None:
    assert describe_difference("fp-a", "fp-b") == "fingerprint 'fp-a' differs from 'fp-b'"
    long = "x" * 100
    assert describe_difference(long, "[1]") == (f"fingerprint '{'x' * 57}...' differs from '[1]'")


def test_the_same_document_written_differently_is_still_reported() -> None:
    stored = json.dumps({"a": 1, "b": 2})
    current = json.dumps({"b": 2, "a": 1})
    assert describe_difference(stored, current).startswith("fingerprint '{")


def test_a_fingerprint_nested_too_deep_to_parse_is_shown_shortened() -> None:
    # Regression (review): json.loads raised RecursionError, not ValueError, and a
    # persistent tier written with such a fingerprint failed every later open (with
    # another fingerprint) instead of being discarded with this warning.
    for stored in ("[" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        message = describe_difference(stored, '{"model": "b"}')
        assert message.startswith("fingerprint '")
        assert message.endswith("""differs from '{"model": "b"}'""")


def test_a_fingerprint_nested_deeper_than_its_leaves_can_walk_is_shown_shortened() -> None:
    depth = 900  # parses, but walking it from a deep stack would recurse too far
    stored = '{"a":' * depth + "1" + "}" * depth

    def nested(levels: int) -> str:
        return describe_difference(stored, "{}") if levels == 0 else nested(levels - 1)

    assert nested(200).startswith("fingerprint ")


def test_a_json_object_against_plain_text_is_shown_as_both_texts() -> None:
    """(s30 mutation run) One side a JSON object, the other not: no key-by-key diff."""
    assert describe_difference('{"a": 1}', "fp-b") == "fingerprint '{\"a\": 1}' differs from 'fp-b'"
    assert describe_difference("fp-a", '{"a": 1}') == "fingerprint 'fp-a' differs from '{\"a\": 1}'"
    assert describe_difference("[1]", "[2]") == "fingerprint '[1]' differs from '[2]'"


def test_exactly_four_differences_are_all_named_and_none_counted() -> None:
    stored = json.dumps({f"k{i}": i for i in range(4)})
    current = json.dumps({f"k{i}": i + 1 for i in range(4)})
    message = describe_difference(stored, current)
    assert message.endswith("k3: 3 -> 4")


def test_a_long_changed_value_is_shortened() -> None:
    message = describe_difference(json.dumps({"path": "p" * 100}), json.dumps({"path": "q"}))
    assert message == (f"fingerprint changed (stored -> this engine): path: '{'p' * 57}...' -> 'q'")
