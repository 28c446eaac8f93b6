"""`ReplayConfig` and `TierConfig` built by hand (the library API, not the CLI): a value
of the wrong kind is refused with a `ReplayError` naming the field, never run as
something else or left to fail deep inside the replay."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from replay_helpers import BLOCK, chat_trace

from kvtier.replay.config import MAX_TOKENS, ReleaseOrder, ReplayConfig, ReplayError, TierConfig
from kvtier.replay.cost import CostModel
from kvtier.replay.tier_replay import replay_trace
from kvtier.replay.trace import MAX_BLOCK_SIZE


def cpu(tokens: Any = 1_000_000) -> TierConfig:
    return TierConfig("CPU", tokens, 25.0)


@pytest.mark.parametrize("order", list(ReleaseOrder))
def test_release_order_given_as_its_value_runs_as_that_order(order: ReleaseOrder) -> None:
    # As `cascade="write_back"` is: before, a string matched no `is ReleaseOrder.X` test,
    # so "tail_first" ran a mix of the scheduler's orders, silently.
    records = chat_trace()
    tier = TierConfig("CPU", 12 * BLOCK, 25.0)
    by_member = ReplayConfig(tiers=(tier,), block_size=BLOCK, policy="arc", release_order=order)
    by_value = ReplayConfig(
        tiers=(tier,),
        block_size=BLOCK,
        policy="arc",
        release_order=order.value,  # type: ignore[arg-type]
    )
    assert by_value.release_order is order
    by_value_run, by_member_run = (
        dataclasses.replace(replay_trace(records, config), runtime_s=0.0)
        for config in (by_value, by_member)
    )
    assert by_value_run == by_member_run


@pytest.mark.parametrize("order", ["bogus", 1, None])
def test_unknown_release_order_is_named_with_the_choices(order: object) -> None:
    with pytest.raises(ReplayError, match=rf"release_order.*{order!r}.*tail_first, scheduler"):
        ReplayConfig(tiers=(cpu(),), release_order=order)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -512, 512.0, True, MAX_BLOCK_SIZE + 1])
def test_block_size_out_of_range_is_named(size: object) -> None:
    # Before: 0 was a ZeroDivisionError in the replay, -512 an LRUPolicy error about
    # num_blocks, 512.0 an error about num_tokens.
    with pytest.raises(ReplayError, match=rf"block_size must be an int in \[1, .*got {size!r}"):
        ReplayConfig(tiers=(cpu(),), block_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [float("nan"), float("inf"), 1.5e6, True])
def test_tier_capacity_must_be_whole_tokens(tokens: object) -> None:
    # Before: NaN and 1.5e6 were accepted (NaN failed in LRUPolicy, 1.5e6 reported a
    # float block count).
    with pytest.raises(ReplayError, match=rf"tier CPU: capacity must be an int.*got {tokens!r}"):
        cpu(tokens)


@pytest.mark.parametrize("tokens", [1024.0, True])
def test_gpu_capacity_must_be_whole_tokens(tokens: object) -> None:
    with pytest.raises(ReplayError, match=rf"gpu_capacity_tokens must be an int.*got {tokens!r}"):
        ReplayConfig(tiers=(cpu(),), gpu_capacity_tokens=tokens)  # type: ignore[arg-type]


def test_negative_check_every_is_named() -> None:
    with pytest.raises(ReplayError, match="check_every must be an int >= 0, got -1"):
        ReplayConfig(tiers=(cpu(),), check_every=-1)


@pytest.mark.parametrize(
    ("given", "name"),
    [("BELADY", "belady"), (" Oracle-LFU ", "oracle-lfu"), (" LRU ", "lru"), ("Arc+ALL", "arc")],
)
def test_policy_name_is_read_as_the_cli_reads_it(given: str, name: str) -> None:
    # Before: "BELADY" was an "unknown eviction policy 'belady'" (it is a valid offline
    # policy), and " LRU " ran but was reported under that label.
    assert ReplayConfig(tiers=(cpu(),), policy=given).policy == name


def test_policy_of_another_type_is_named() -> None:
    with pytest.raises(ReplayError, match=r"policy must be a str .* got None"):
        ReplayConfig(tiers=(cpu(),), policy=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [1.5, 131072.0, float("nan"), float("inf"), True, "128", 0, -1])
def test_bytes_per_token_that_is_not_a_positive_int_is_refused(value: Any) -> None:
    # Regression: 1.5, 131072.0, NaN and inf were taken (a float byte count per block),
    # True as 1 byte, and "128" failed with a bare TypeError.
    with pytest.raises(ValueError, match=rf"bytes_per_token must be an int > 0 .*got {value!r}"):
        CostModel(bytes_per_token=value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_rates_that_are_not_positive_finite_numbers_are_refused(value: Any) -> None:
    # NaN, inf and <= 0 were refused already; True ran as 1 and "10" failed with a bare
    # TypeError.
    with pytest.raises(ValueError, match=rf"prefill_tokens_per_s must be a number > 0 .*{value!r}"):
        CostModel(prefill_tokens_per_s=value)
    with pytest.raises(ReplayError, match=rf"tier CPU: link_gbps must be a number > 0 .*{value!r}"):
        TierConfig("CPU", 1_000_000, value)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("CPU", "cpu"), "tiers 'CPU' and 'cpu' both name the result columns 'cpu_"),
        (("CPU", "DISK", "Disk"), "tiers 'DISK' and 'Disk' both name the result columns 'disk_"),
        (("GPU",), "tier 'GPU' would name the result column 'gpu_token_hit_ratio'"),
        (("CPU", "Total"), "tier 'Total' would name the result column 'total_token_hit_ratio'"),
    ],
)
def test_tier_names_that_share_result_columns_are_refused(
    names: tuple[str, ...], message: str
) -> None:
    # Before: accepted, and each point's CSV / JSON row (`point_row`) kept only the last
    # of the tiers' `{name}_...` columns (CPU 3 blocks and cpu 30 blocks: one row
    # cpu_token_hit_ratio 0.064, the CPU tier's 0.030 gone), or overwrote the GPU tier's
    # and the total hit ratio with a lower tier's.
    tiers = tuple(TierConfig(name, 8 * BLOCK, 25.0) for name in names)
    with pytest.raises(ReplayError, match=re.escape(message)):
        ReplayConfig(tiers=tiers, block_size=BLOCK)


def test_a_capacity_above_10_to_the_18_tokens_is_refused_naming_the_field() -> None:
    """The CLI refuses such a `--capacity`; the library took any (the CSV and JSON's
    64-bit readers cannot hold one above 2**63)."""
    bound = "at most 1,000,000,000,000,000,000 \\(10\\*\\*18\\), got 1000000000000000001"
    ReplayConfig(tiers=(cpu(MAX_TOKENS),), gpu_capacity_tokens=MAX_TOKENS)  # the bound is taken
    with pytest.raises(ReplayError, match=f"^tier CPU: capacity_tokens must be {bound}$"):
        cpu(MAX_TOKENS + 1)
    with pytest.raises(ReplayError, match=f"^gpu_capacity_tokens must be {bound}$"):
        ReplayConfig(tiers=(cpu(),), gpu_capacity_tokens=MAX_TOKENS + 1)


def test_a_named_tier_gets_its_own_default_link() -> None:
    """`TierConfig.named`: CPU 25 GB/s, DISK 5 GB/s (`cost.DEFAULT_LINK_GBPS`)."""
    assert TierConfig.named("CPU", 100).link_gbps == 25.0
    assert TierConfig.named("DISK", 100).link_gbps == 5.0


def test_the_largest_block_size_is_taken() -> None:
    config = ReplayConfig(
        tiers=(TierConfig.named("CPU", MAX_BLOCK_SIZE),), block_size=MAX_BLOCK_SIZE
    )
    assert config.block_size == MAX_BLOCK_SIZE


def test_a_negative_gpu_capacity_is_refused() -> None:
    with pytest.raises(ReplayError, match=r"^gpu capacity must be 0 \(no GPU tier\) or at least"):
        ReplayConfig(
            tiers=(TierConfig.named("CPU", 10 * BLOCK),), block_size=BLOCK, gpu_capacity_tokens=-1
        )
