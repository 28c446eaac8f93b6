"""Unknown keys in `kv_connector_extra_config` (pure Python: runs without vLLM): the
closest valid key is offered only where following it works, and a key with none lists
the keys that do. The two spellings of a setting (kvtier's `cpu_bytes`..., vLLM
SimpleCPUOffloadConnector's `cpu_bytes_to_use`...) are refused together, so a key of the
other spelling than the one given is never offered; nor one of the other tier, nor a
non-size key for a size (Scenario 27: an unknown key raises a clear error)."""

from __future__ import annotations

import re

import pytest
from test_vllm_config_edges import GIB, convert

from kvtier.offload.config import ConfigError, OffloadConfig


def refusal(extra: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as error:
        convert(extra)
    return str(error.value)


@pytest.mark.parametrize(
    ("extra", "suggestion"),
    [
        # Was 'cpu_bytes_to_use_per_rank' (refused with num_blocks: "use one spelling").
        ({"num_blocks": 4, "cpu_bytes_per_rank": 1}, "cpu_bytes"),
        ({"cpu_bytes_to_use": GIB, "cpu_bytes_per_rank": 1}, "cpu_bytes_to_use_per_rank"),
        # Was 'num_blocks' (refused with cpu_bytes_to_use).
        ({"cpu_bytes_to_use": GIB, "num_block": 5}, "num_cpu_blocks"),
        # Was 'disk_persist' (a bool, and only False is taken by the connector).
        ({"cpu_bytes": GIB, "disk_size": 5}, "disk_bytes"),
        ({"cpu_bytes": GIB, "direct_io": True}, "disk_direct_io"),
        # Was 'eviction_policy' (refused with policy), then 'policy', the key given.
        ({"policy": "lru", "evicton_policy": "lru"}, None),
    ],
)
def test_only_a_key_that_goes_with_the_others_is_offered(
    extra: dict[str, object], suggestion: str | None
) -> None:
    message = refusal(extra)
    if suggestion is None:
        assert "did you mean" not in message
        assert "keys like it" not in message  # nor the key given (policy) as a hint
    else:
        assert f"(did you mean {suggestion!r}?)" in message
        assert "valid" not in message  # a key with a suggestion lists nothing


@pytest.mark.parametrize(
    ("extra", "misspelt", "repeated"),
    [
        # Was 'keys like it: disk_bytes', and the keys listed.
        ({"cpu_bytes": GIB, "pcu_bytes": GIB}, "pcu_bytes", "cpu_bytes"),
        # Was "did you mean 'cpu_bytes_to_use_per_rank'?".
        (
            {"cpu_bytes_to_use": GIB, "pcu_bytes_to_use": GIB},
            "pcu_bytes_to_use",
            "cpu_bytes_to_use",
        ),
        # Was 'keys like it: cpu_bytes_to_use, cpu_bytes_to_use_per_rank', and the keys listed.
        ({"num_cpu_blocks": 4, "num_cpu_block": 4}, "num_cpu_block", "num_cpu_blocks"),
    ],
)
def test_a_key_closest_to_one_given_is_said_to_repeat_it(
    extra: dict[str, object], misspelt: str, repeated: str
) -> None:
    """(s31) A second CPU size by a typo beside the first is told so, never steered to
    another setting (the disk tier's size, the per-rank size) nor given the key listing."""
    named = f"{misspelt} (looks like {repeated!r}, which is given already)"
    assert refusal(extra) == f"unknown kv_connector_extra_config key: {named}"


@pytest.mark.parametrize(
    ("extra", "not_offered"),
    [
        # Was "did you mean 'cpu_bytes_to_use'?": the CPU tier's size.
        ({"cpu_bytes_to_use": GIB, "disk_bytes_to_use": 5}, "cpu_bytes_to_use"),
        # Was 'cpu_bytes_to_use_per_rank'.
        ({"cpu_bytes_to_use": GIB, "disk_bytes_per_rank": 5}, "cpu_bytes_to_use_per_rank"),
        # Was 'disk_capacity_bytes'.
        ({"kv_offload_backend": "cascade", "cpu_capacity_bytes": 5}, "disk_capacity_bytes"),
        # Was 'store_mode' (refused with SimpleCPUOffloadConnector's keys).
        ({"cpu_bytes_to_use": GIB, "store": "lazy"}, "store_mode"),
    ],
)
def test_a_key_of_the_other_tier_or_spelling_is_never_offered(
    extra: dict[str, object], not_offered: str
) -> None:
    message = refusal(extra)
    assert "did you mean" not in message, not_offered


def test_a_key_with_no_close_match_lists_the_keys_that_go_with_the_others() -> None:
    # Was: "unknown kv_connector_extra_config key(s): lazy", and nothing to go by.
    message = refusal({"cpu_bytes": GIB, "lazy": True})
    unknown, _, listed = message.partition("; keys valid with the others given: ")
    assert unknown == "unknown kv_connector_extra_config key: lazy"
    keys = listed.split(", ")
    assert {"cpu_bytes", "disk_bytes", "num_blocks", "store_mode", "policy"} <= set(keys)
    assert not {"lazy_offload", "cpu_bytes_to_use", "disk_persist", "hash_seed"} & set(keys)
    clashes = []
    for key in set(keys) - {"cpu_bytes"}:  # every key listed goes with cpu_bytes
        try:
            convert({"cpu_bytes": GIB, key: {"disk_path": "/tmp", "policy": "lru"}.get(key, 0)})
        except ConfigError as error:
            clashes += [key] if "spelling" in str(error) else []
    assert clashes == []


def test_the_offload_config_lists_its_keys_for_a_key_with_no_close_match() -> None:
    with pytest.raises(ConfigError) as error:
        OffloadConfig.from_dict({"cpu_bytes": 640, "zzz": 1})
    unknown, _, listed = str(error.value).partition("; valid keys: ")
    assert unknown == "unknown offload config key: zzz"
    assert "cpu_bytes" in listed.split(", ")
    assert "hash_seed" in listed.split(", ")


@pytest.mark.parametrize(
    ("extra", "suggestion"),
    [
        # Was 'store_mode' (another setting: the closest, disk_io_mode, clashes).
        ({"disk_direct_io": True, "dis_io_mode": "direct"}, None),
        # Was 'disk_io_mode' (store_mode clashes with SimpleCPUOffloadConnector's keys).
        ({"cpu_bytes_to_use": GIB, "stor_mode": "lazy"}, None),
        # Was 'disk_path': the disk size in the spelling given.
        ({"cpu_bytes_to_use": GIB, "disk_byte": 5}, "disk_capacity_bytes"),
        # Was 'disk_path' / 'disk_bytes': False is taken, True refused with its reason.
        ({"cpu_bytes": GIB, "disk_persit": False}, "disk_persist"),
        ({"cpu_bytes": GIB, "disk_persis": False}, "disk_persist"),
        # Not 'num_cpu_blocks', num_blocks' other spelling: it is given beside the typo.
        ({"cpu_bytes": GIB, "num_cpu_blocks": 4, "num_bloks": 1}, None),
    ],
)
def test_a_key_not_offered_is_never_replaced_by_another_setting(
    extra: dict[str, object], suggestion: str | None
) -> None:
    message = refusal(extra)
    if suggestion is None:
        assert "did you mean" not in message
        assert "; keys valid with the others given: " in message
    else:
        assert f"(did you mean {suggestion!r}?" in message  # and a note on it: see below


# A setting's two spellings (kvtier's, SimpleCPUOffloadConnector's).
_SPELLINGS = [
    {"cpu_bytes", "cpu_bytes_to_use", "cpu_bytes_to_use_per_rank"},
    {"disk_bytes", "disk_capacity_bytes"},
    {"num_blocks", "num_cpu_blocks"},
    {"store_mode", "lazy_offload"},
]


@pytest.mark.parametrize(
    "others",
    [{}, {"cpu_bytes": GIB}, {"cpu_bytes_to_use": GIB}, {"policy": "lru"}, {"disk_io_mode": "io"}],
)
def test_a_key_missing_a_letter_is_offered_only_as_itself_or_its_other_spelling(
    others: dict[str, object],
) -> None:
    keys = sorted(set().union(*_SPELLINGS) | {"disk_io_mode", "disk_persist", "disk_path"})
    wrong = []
    for key in (k for k in keys if k not in others):
        same = next((s for s in _SPELLINGS if key in s), {key})
        for typo in {key[:i] + key[i + 1 :] for i in range(len(key))} - set(keys):
            found = re.search(r"did you mean '(\w+)'", refusal({**others, typo: 1}))
            if found and found[1] not in same:
                wrong.append(f"{typo} -> {found[1]}")
    assert wrong == []


def test_a_key_that_reads_like_a_suggestion_still_gets_the_listing() -> None:
    message = refusal({"cpu_bytes": GIB, "x (did you mean 'y'?)": 1})
    assert "; keys valid with the others given: " in message


@pytest.mark.parametrize(
    "key", ["cpu_size", "cpu_memory", "host_memory", "disk_size", "cpu_capacity"]
)
@pytest.mark.parametrize(
    "others",
    [{}, {"kv_offload_backend": "cpu"}, {"cpu_bytes_to_use": GIB}, {"num_blocks": 4}],
)
def test_a_size_key_with_no_close_match_names_the_size_keys_that_go_with_the_others(
    key: str, others: dict[str, object]
) -> None:
    """Was: no hint for `cpu_size`, only the list of some 20 keys; each key hinted at
    works beside the others given, and none is of the other tier."""
    message = refusal({**others, key: GIB})
    if "did you mean" in message:
        return  # disk_size: disk_bytes, checked by the tests above
    found = re.search(rf"{key} \(keys like it: ([\w, ]+)[;)]", message)
    assert found, message
    other_tier = "cpu" if key.startswith("disk") else "disk"
    for hinted in found[1].split(", "):
        assert hinted.endswith("bytes") or "_bytes_" in hinted, hinted
        assert other_tier not in hinted, hinted
        path = {"disk_path": "/tmp"} if "disk" in hinted else {}
        convert({**others, **path, hinted: GIB})  # raises nothing


@pytest.mark.parametrize(
    ("extra", "typo", "offered"),
    [
        ({"kv_offload_backend": "cpu", "disk_size": GIB}, "disk_size", "disk_capacity_bytes"),
        ({"cpu_bytes_to_use": GIB, "disk_size": GIB}, "disk_size", "disk_capacity_bytes"),
        ({"disk_capacity_byte": GIB}, "disk_capacity_byte", "disk_capacity_bytes"),
        ({"kv_offload_backend": "cpu", "use_page_cach": True}, "use_page_cach", "use_page_cache"),
        ({"kv_offload_backend": "cpu", "disk_pth": "/tmp"}, "disk_pth", "disk_path"),
        (
            {"kv_offload_backend": "disk", "disk_path": "/tmp", "cpu_size": GIB},
            "cpu_size",
            "cpu_bytes_to_use",
        ),
    ],
)
def test_a_key_offered_that_the_backend_would_ignore_says_so(
    extra: dict[str, object], typo: str, offered: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Was "disk_size (keys like it: disk_capacity_bytes)" alone: written so, the size
    was ignored with a warning (kv_offload_backend "cpu", the default, has no disk
    tier), and the connector ran without the disk tier the user asked for."""
    message = refusal(extra)
    tier = "CPU" if extra.get("kv_offload_backend") == "disk" else "disk"
    hint = re.search(rf"{typo} \((did you mean|keys like it:) '?{offered}\b.*", message)
    assert hint, message
    assert f"has no {tier} tier: set kv_offload_backend to" in hint[0]
    config = convert({**{k: v for k, v in extra.items() if k != typo}, offered: extra[typo]})
    assert (config.cpu_bytes if tier == "CPU" else config.disk_bytes) == 0  # the note is true
    assert f"ignoring {offered}" in caplog.text


def test_a_note_on_several_keys_hinted_at_is_said_once() -> None:
    message = refusal({"use_page_cache": False, "disk_direct_slots": 1})
    assert "keys like it: disk_buffer_slots, disk_capacity_bytes, disk_path; " in message
    assert message.count("has no disk tier") == 1


@pytest.mark.parametrize("key", ["use", "to_use"])
def test_a_key_of_filler_words_alone_is_hinted_nothing(key: str) -> None:
    """`to`, `use`, `per` join the words of a key (`cpu_bytes_to_use_per_rank`): no hint."""
    message = refusal({key: 1})
    assert f"key: {key}; keys valid with the others given: " in message


@pytest.mark.parametrize("backend", ["cascade", "disk"])
def test_a_key_offered_for_a_tier_the_backend_has_comes_without_a_note(backend: str) -> None:
    message = refusal({"kv_offload_backend": backend, "disk_size": GIB})
    assert "disk_size (keys like it: disk_capacity_bytes); keys valid" in message


def test_a_note_on_the_backend_says_whether_it_was_written_or_is_the_default() -> None:
    note = "kv_offload_backend='cpu'{} has no disk tier"
    assert note.format(" (its default)") in refusal({"cpu_bytes_to_use": GIB, "disk_size": GIB})
    assert note.format("") in refusal({"kv_offload_backend": "cpu", "disk_size": GIB})


def test_a_note_follows_a_question_after_a_space_and_a_list_after_a_semicolon() -> None:
    note = "kv_offload_backend='cpu' has no disk tier"
    offered = refusal({"kv_offload_backend": "cpu", "use_page_cach": True})
    assert f"use_page_cach (did you mean 'use_page_cache'? {note}: set " in offered
    hinted = refusal({"kv_offload_backend": "cpu", "disk_size": GIB})
    assert f"disk_size (keys like it: disk_capacity_bytes; {note}: set " in hinted


def test_host_memory_is_never_steered_to_the_disk_tier() -> None:
    """Was "host_bytes (did you mean 'disk_bytes'?)": host memory is the CPU tier."""
    assert "host_bytes (did you mean 'cpu_bytes'?)" in refusal({"host_bytes": GIB})
    with pytest.raises(ConfigError, match=r"host_bytes \(did you mean 'cpu_bytes'\?\)"):
        OffloadConfig.from_dict({"host_bytes": GIB})


@pytest.mark.parametrize(
    "key", ["gpu_bytes_to_use", "num_gpu_blocks", "gpu_memory", "GPU_bytes", "gpu_blocks"]
)
def test_a_gpu_key_is_never_steered_to_a_tier_of_kvtier_s(key: str) -> None:
    """Was "gpu_bytes_to_use (did you mean 'cpu_bytes_to_use'?)", "num_gpu_blocks (did you
    mean 'num_cpu_blocks'?)": the GPU's KV cache is vLLM's to size, not a tier's."""
    gpu_hint = f"{key} (kvtier sizes its CPU and disk tiers; the GPU's KV cache is the engine's)"
    assert gpu_hint in refusal({key: GIB})
    with pytest.raises(ConfigError) as refused:
        OffloadConfig.from_dict({key: GIB})
    assert gpu_hint in str(refused.value)
