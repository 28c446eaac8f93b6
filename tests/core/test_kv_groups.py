"""Tests for kvtier.core.kv_groups (SPEC §1, §5)."""

from __future__ import annotations

import pytest

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout, tokens_inside_block

FULL = GroupKind.FULL_ATTENTION
SLIDING = GroupKind.SLIDING_WINDOW
STATE = GroupKind.STATE
SCRATCH = GroupKind.SCRATCH


def group(
    kind: GroupKind = FULL,
    block_size: int = 16,
    bytes_per_block: int = 1024,
    sliding_window: int | None = None,
) -> KVGroupSpec:
    if kind is SLIDING and sliding_window is None:
        sliding_window = 4 * block_size
    return KVGroupSpec(kind, block_size, bytes_per_block, sliding_window)


def layout(*groups: KVGroupSpec, hash_block_size: int | None = None) -> KVLayout:
    return KVLayout(tuple(groups), hash_block_size)


# --- group validation ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -16, 16.0, "16", None])
def test_bad_block_size_is_rejected_and_named(block_size: object) -> None:
    """A non-positive or non-int block size raises a ValueError naming the value."""
    with pytest.raises(ValueError, match=rf"block_size.*{block_size!r}"):
        KVGroupSpec(FULL, block_size, 1024)  # type: ignore[arg-type]


@pytest.mark.parametrize("bytes_per_block", [-1, 1.5, "1024", None])
def test_bad_bytes_per_block_is_rejected_and_named(bytes_per_block: object) -> None:
    """A negative or non-int bytes_per_block raises a ValueError naming the value."""
    with pytest.raises(ValueError, match=rf"bytes_per_block.*{bytes_per_block!r}"):
        KVGroupSpec(FULL, 16, bytes_per_block)  # type: ignore[arg-type]


def test_zero_bytes_per_block_is_allowed() -> None:
    """A group may span no bytes (e.g. a scratch group with nothing to copy)."""
    assert KVGroupSpec(SCRATCH, 16, 0).bytes_per_block == 0


@pytest.mark.parametrize("window", [None, 0, -4, 8.0])
def test_sliding_group_needs_positive_int_window(window: object) -> None:
    """A sliding-window group without a positive int window is rejected, naming it."""
    with pytest.raises(ValueError, match=rf"sliding_window.*{window!r}"):
        KVGroupSpec(SLIDING, 16, 1024, window)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [FULL, STATE, SCRATCH])
def test_window_on_other_kinds_is_rejected(kind: GroupKind) -> None:
    """Only sliding-window groups may carry a window; the error names the kind."""
    with pytest.raises(ValueError, match=kind.name):
        KVGroupSpec(kind, 16, 1024, sliding_window=32)


@pytest.mark.parametrize("field", ["block_size", "bytes_per_block", "sliding_window"])
def test_bool_values_are_rejected(field: str) -> None:
    """True is not a block size, a byte count or a window (bool is an int subclass)."""
    values: dict[str, object] = {"block_size": 16, "bytes_per_block": 1024, "sliding_window": 64}
    values[field] = True
    with pytest.raises(ValueError, match=field):
        KVGroupSpec(SLIDING, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", list(GroupKind))
def test_a_kind_given_by_its_value_is_that_kind(kind: GroupKind) -> None:
    """KVGroupSpec("full_attention", ...) is a full-attention group.

    A str kind used to be kept as is: it matched no kind, so the group was neither
    positional nor full attention, and the longest hit judged it as a state group.
    """
    window = 64 if kind is SLIDING else None
    spec = KVGroupSpec(kind.value, 16, 1024, window)  # type: ignore[arg-type]
    assert spec.kind is kind
    assert spec == KVGroupSpec(kind, 16, 1024, window)


@pytest.mark.parametrize("kind", ["full", "FULL_ATTENTION", 3, None])
def test_an_unknown_kind_is_rejected_and_named(kind: object) -> None:
    """A kind that is no GroupKind (nor one's value) raises, naming it and the choices."""
    with pytest.raises(ValueError, match=rf"unknown group kind {kind!r}.*full_attention"):
        KVGroupSpec(kind, 16, 1024)  # type: ignore[arg-type]


def test_group_kind_properties() -> None:
    """Scratch is the only non-cacheable kind; full and sliding are positional."""
    assert [group(k).is_cacheable for k in (FULL, SLIDING, STATE, SCRATCH)] == [
        True,
        True,
        True,
        False,
    ]
    assert [group(k).is_positional for k in (FULL, SLIDING, STATE, SCRATCH)] == [
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("window", "block_size", "expected"),
    [
        (1, 16, 0),  # a token attends only to itself
        (2, 16, 1),
        (16, 16, 1),
        (17, 16, 1),  # 16 earlier tokens fit in exactly one block
        (18, 16, 2),
        (33, 16, 2),
        (34, 16, 3),
        (4096, 32, 128),  # 4095 / 32 -> 127.97
        (4097, 32, 128),
    ],
)
def test_num_window_blocks_is_ceil_of_window_minus_one(
    window: int, block_size: int, expected: int
) -> None:
    """num_window_blocks = ceil((window - 1) / block_size)."""
    assert group(SLIDING, block_size, sliding_window=window).num_window_blocks == expected


# --- layout geometry ----------------------------------------------------------------


def test_empty_layout_is_rejected() -> None:
    """A layout needs at least one group."""
    with pytest.raises(ValueError, match="at least one group"):
        KVLayout(())


def test_layout_groups_become_a_tuple_and_must_be_group_specs() -> None:
    """A list of groups is kept as a tuple (the layout stays hashable); others are refused."""
    spec = group()
    listed = KVLayout([spec])  # type: ignore[arg-type]
    assert listed.groups == (spec,)
    assert hash(listed) == hash(layout(spec))
    with pytest.raises(TypeError, match="group 1 is 'x', not a KVGroupSpec"):
        KVLayout((spec, "x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="groups must be a tuple"):
        KVLayout(spec)  # type: ignore[arg-type]


def test_single_layout() -> None:
    """KVLayout.single is one full-attention group with equal scheduler and hash block."""
    single = KVLayout.single(16, 2048)
    assert single.groups == (KVGroupSpec(FULL, 16, 2048),)
    assert single.scheduler_block_size == single.hash_block_size == 16
    assert single.bytes_per_block == 2048


@pytest.mark.parametrize(
    ("block_sizes", "scheduler", "hash_"),
    [
        ((16,), 16, 16),
        ((16, 32), 32, 16),
        ((32, 16, 64), 64, 16),
        ((16, 24), 48, 8),
        ((12, 18, 8), 72, 2),
        ((7, 5), 35, 1),
    ],
)
def test_scheduler_block_is_lcm_and_hash_block_is_gcd(
    block_sizes: tuple[int, ...], scheduler: int, hash_: int
) -> None:
    """Scheduler block = LCM of group block sizes; default hash block = their GCD."""
    lay = layout(*(group(FULL, bs) for bs in block_sizes))
    assert lay.scheduler_block_size == scheduler
    assert lay.hash_block_size == hash_


def test_configured_hash_block_overrides_gcd() -> None:
    """A configured hash block that divides every block size is used as is."""
    lay = layout(group(FULL, 32), group(STATE, 64), hash_block_size=8)
    assert lay.hash_block_size == 8
    assert lay.scheduler_block_size == 64
    assert [lay.blocks_per_hash(g) for g in range(2)] == [4, 8]


@pytest.mark.parametrize("hbs", [12, 48, 96])
def test_configured_hash_block_must_divide_every_block(hbs: int) -> None:
    """A hash block that does not divide some group's block size names both numbers."""
    with pytest.raises(ValueError, match=rf"hash_block_size {hbs} .* 32 of group 1"):
        layout(group(FULL, 96), group(SLIDING, 32), hash_block_size=hbs)


@pytest.mark.parametrize("hbs", [0, -16, 16.0, "16"])
def test_configured_hash_block_must_be_positive_int(hbs: object) -> None:
    """A non-positive or non-int configured hash block is rejected, naming the value."""
    with pytest.raises(ValueError, match=rf"hash_block_size.*{hbs!r}"):
        layout(group(FULL, 16), hash_block_size=hbs)  # type: ignore[arg-type]


def test_bytes_per_block_is_the_sum_over_groups() -> None:
    """One tier slot spans every group's bytes, scratch included."""
    lay = layout(group(FULL, bytes_per_block=100), group(STATE, bytes_per_block=7), group(SCRATCH))
    assert lay.bytes_per_block == 100 + 7 + 1024


def test_cacheable_group_ids_exclude_scratch() -> None:
    """Scratch groups are left out of cacheable_group_ids; order is kept."""
    lay = layout(group(SCRATCH), group(FULL), group(SCRATCH), group(SLIDING), group(STATE))
    assert lay.cacheable_group_ids == (1, 3, 4)


def test_blocks_per_hash() -> None:
    """blocks_per_hash is how many hash blocks one block of the group spans."""
    lay = layout(group(FULL, 64), group(SLIDING, 16), group(STATE, 32))
    assert [lay.blocks_per_hash(g) for g in range(3)] == [4, 1, 2]


def test_coarse_state_groups_are_the_state_groups_spanning_several_hash_blocks() -> None:
    """Only a state group's block keyed inside it is never served (SPEC §5): a full or
    sliding group's is, and a state block of one hash block has no inside. Mutants
    (s35): any kind, or a state block of exactly one hash block, counted as coarse
    passed every core test."""
    lay = layout(group(FULL, 32), group(SLIDING, 32), group(STATE, 32), group(STATE, 16))
    assert lay.hash_block_size == 16
    assert lay.coarse_state_groups == {2: 32}


def test_keys_inside_blocks_ignores_scratch_groups() -> None:
    """A scratch group is never stored, so its block size keys nothing. Mutant (s35):
    scratch groups counted passed every core test."""
    assert not layout(group(FULL, 16), group(SCRATCH, 64)).keys_inside_blocks
    assert layout(group(FULL, 16), group(STATE, 32)).keys_inside_blocks


@pytest.mark.parametrize(
    ("prefix_tokens", "expected"), [(1, 1), (15, 15), (16, 16), (17, 1), (53, 5), (64, 16)]
)
def test_tokens_inside_block_counts_a_whole_block_as_its_size(
    prefix_tokens: int, expected: int
) -> None:
    """vLLM's count of the tokens inside the block a prefix ends in: a prefix ending on a
    block boundary fills its block. Mutant (s35): 15 there passed every core test."""
    assert tokens_inside_block(prefix_tokens, 16) == expected


# --- fine-grained hits --------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "hbs", "expected"),
    [
        # one full group: coarse only when the hash block is configured smaller
        ((group(FULL, 16),), None, False),
        ((group(FULL, 32),), 16, True),
        # coarse full + fine state / sliding / full
        ((group(FULL, 32), group(STATE, 16)), None, True),
        ((group(FULL, 32), group(SLIDING, 16)), None, True),
        ((group(FULL, 32), group(FULL, 16)), None, True),
        ((group(FULL, 64), group(FULL, 32), group(STATE, 16)), None, True),
        # a coarse non-full group cannot end inside its block
        ((group(FULL, 32), group(STATE, 32)), 16, False),
        ((group(FULL, 32), group(SLIDING, 32), group(STATE, 16)), None, False),
        # no coarse full-attention group
        ((group(FULL, 16), group(SLIDING, 16)), None, False),
        ((group(FULL, 16), group(STATE, 32)), None, False),
        # scratch groups are ignored, whatever their block size
        ((group(FULL, 32), group(SCRATCH, 64)), 16, True),
        ((group(SCRATCH, 32), group(STATE, 16)), None, False),
    ],
)
def test_supports_fine_grained_hits(
    groups: tuple[KVGroupSpec, ...], hbs: int | None, expected: bool
) -> None:
    """Fine-grained hits need a coarse full group and every other group at the hash block."""
    assert layout(*groups, hash_block_size=hbs).supports_fine_grained_hits is expected
