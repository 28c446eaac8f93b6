"""`HostTier`'s refusals, sizes and invariant checks (s33 mutation run on
`transfer/host_tier.py`: each test failed on a mutant that passed every older test)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.transfer import host_tier
from kvtier.transfer.host_tier import HostTier


@pytest.mark.parametrize(
    ("sizes", "num_slots", "message"),
    [
        ([16], 0, "host tier needs a positive slot count, got 0"),
        ([], 4, r"host tier needs positive region sizes, got \[\]"),
        ([16, 0], 4, r"host tier needs positive region sizes, got \[16, 0\]"),
    ],
)
def test_an_empty_tier_is_refused(sizes: list[int], num_slots: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HostTier(sizes, num_slots, pin=False)


def test_a_slot_holds_every_regions_bytes_zeroed() -> None:
    """A slot is the sum of its regions' bytes; fresh memory reads as zeros (it was
    written, which also touched every page), even where freed memory is reused."""
    for _ in range(8):  # leave freed, non-zero chunks of the sizes asked below
        torch.full((3, 16), 0xAB, dtype=torch.uint8)
        torch.full((3, 40), 0xAB, dtype=torch.uint8)
    tier = HostTier([16, 40], num_slots=3, pin=False)
    assert tier.bytes_per_slot == 56
    assert [tuple(v.shape) for v in tier.views] == [(3, 16), (3, 40)]
    assert all(not bool(v.any()) for v in tier.views)
    tier.check_invariants()


def test_an_interrupted_pin_unpins_the_regions_pinned_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C while the second region is being pinned leaves the first unpinned: no
    page-locked memory outlives a tier that was never built."""
    pinned: list[int] = []
    unpinned: list[int] = []

    def pin(tensor: torch.Tensor) -> None:
        if pinned:
            raise KeyboardInterrupt
        pinned.append(tensor.shape[1])

    monkeypatch.setattr(host_tier, "pin_host_memory", pin)
    monkeypatch.setattr(host_tier, "unpin_host_memory", lambda t: unpinned.append(t.shape[1]))
    with pytest.raises(KeyboardInterrupt):
        HostTier([16, 32], num_slots=2, pin=True)
    assert unpinned == pinned == [16]


def test_an_allocation_refused_by_a_memory_error_names_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Allocators raise MemoryError (numpy, Python) or RuntimeError (torch): either is
    told as the CPU tier's size, slots times the bytes of a whole slot."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError("out of memory")

    monkeypatch.setattr(host_tier.torch, "zeros", refuse)
    with pytest.raises(MemoryError, match=r"cpu_num_slots=5 slots x 48 B per slot = 240 B"):
        HostTier([16, 32], num_slots=5, pin=False)


def _replace_view(tier: HostTier, view: torch.Tensor) -> None:
    tier.views = (view, *tier.views[1:])


CORRUPTIONS: dict[str, tuple[Callable[[HostTier], None], str]] = {
    "a region lost slots": (
        lambda t: _replace_view(t, t.views[0][:3]),
        "region has 3 slots",
    ),
    "a region of another dtype": (
        lambda t: _replace_view(t, torch.zeros(4, 2, dtype=torch.int64)),
        "region tensor is torch.int64",
    ),
    "a strided region": (
        lambda t: _replace_view(t, torch.zeros(16, 4, dtype=torch.uint8)[::4]),
        "region tensor is not contiguous",
    ),
    "a region in a larger allocation": (
        lambda t: _replace_view(t, torch.zeros(8, 16, dtype=torch.uint8)[:4]),
        "memory beyond the budget",
    ),
    "partly pinned": (
        lambda t: t._pinned.append(t.views[0]),
        "partly pinned",
    ),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_check_invariants_sees_a_corrupt_tier(case: str) -> None:
    corrupt, message = CORRUPTIONS[case]
    tier = HostTier([16, 8], num_slots=4, pin=False)
    tier.check_invariants()
    corrupt(tier)
    with pytest.raises(AssertionError, match=message):
        tier.check_invariants()
