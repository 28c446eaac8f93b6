"""`HostTier.close` (SPEC §7): one region failing to unpin must not leave the others pinned;
the cleanup of a failed pin must not hide the pin failure."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.transfer import host_tier
from kvtier.transfer.host_tier import HostTier
from kvtier.transfer.worker_resources import WorkerResources


def test_close_unpins_every_region_and_raises_the_first_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unpinned: list[int] = []

    def unpin(tensor: torch.Tensor) -> None:
        unpinned.append(tensor.shape[1])
        if len(unpinned) == 1:
            raise RuntimeError("cudaHostUnregister failed with CUDA error 1")

    monkeypatch.setattr(host_tier, "pin_host_memory", lambda tensor: None)
    monkeypatch.setattr(host_tier, "unpin_host_memory", unpin)
    tier = HostTier([16, 32, 64], num_slots=2, pin=True)
    assert tier.is_pinned
    with pytest.raises(RuntimeError, match="CUDA error 1"):
        tier.close()
    assert sorted(unpinned) == [16, 32, 64]  # the two after the failure were unpinned too
    assert not tier.is_pinned
    tier.close()  # idempotent: nothing left to unpin
    assert len(unpinned) == 3


def test_a_failed_pin_is_raised_even_when_its_cleanup_fails_to_unpin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the second region failing to pin, then the first failing to unpin,
    raised the unpin error (the cause, the pin failure, only as its context)."""
    pinned: list[int] = []

    def pin(tensor: torch.Tensor) -> None:
        if pinned:
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        pinned.append(tensor.shape[1])

    def unpin(tensor: torch.Tensor) -> None:
        raise RuntimeError("cudaHostUnregister failed with CUDA error 1")

    monkeypatch.setattr(host_tier, "pin_host_memory", pin)
    monkeypatch.setattr(host_tier, "unpin_host_memory", unpin)
    with pytest.raises(RuntimeError, match="CUDA error 2") as info:
        HostTier([16, 32], num_slots=2, pin=True)
    assert pinned == [16]
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1
    assert "CUDA error 1" in notes[0]


def test_an_interrupted_unpin_still_unpins_every_other_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a KeyboardInterrupt in one region's unpin left the regions after it
    pinned, and the worker detaches its host tier before closing it, so no retried
    `shutdown()` ever unpinned them (their memory then freed while page-locked)."""
    unpinned: list[int] = []

    def unpin(tensor: torch.Tensor) -> None:
        unpinned.append(tensor.shape[1])
        if len(unpinned) == 1:
            raise RuntimeError("cudaHostUnregister failed with CUDA error 1")
        if len(unpinned) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(host_tier, "pin_host_memory", lambda tensor: None)
    monkeypatch.setattr(host_tier, "unpin_host_memory", unpin)
    tier = HostTier([16, 32, 64, 128], num_slots=2, pin=True)
    resources = WorkerResources(rank=0, lanes=(), owner=threading.current_thread(), host=tier)
    with pytest.raises(KeyboardInterrupt):  # the interrupt wins over the earlier CUDA error
        resources.release_tiers()
    assert sorted(unpinned) == [16, 32, 64, 128]
    assert not tier.is_pinned
    assert resources.host is None
