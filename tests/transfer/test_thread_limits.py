"""`limit_intra_op_threads` bounds torch's CPU threads on the calling thread only (s33
mutation run on `transfer/threads.py`: each test failed on a mutant that passed every
older test)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from kvtier.transfer.threads import limit_intra_op_threads


def _on_a_new_thread(num_threads: int) -> tuple[bool, int]:
    result: list[tuple[bool, int]] = []

    def run() -> None:
        limited = limit_intra_op_threads(num_threads)
        result.append((limited, torch.get_num_threads()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def _has_openmp() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "omp_set_num_threads")
    except OSError:
        return False


@pytest.mark.skipif(not _has_openmp(), reason="this torch build reaches no OpenMP runtime")
def test_the_calling_thread_gets_the_bound_and_no_other() -> None:
    """A bound other than the process's count (here one more) holds on the calling
    thread; the test's own thread keeps its count."""
    before = torch.get_num_threads()
    assert _on_a_new_thread(before + 1) == (True, before + 1)
    assert torch.get_num_threads() == before


def test_a_bound_that_did_not_take_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The result says whether torch now reports the bound: a runtime that ignores the
    call is not reported as a success."""

    class Deaf:
        def omp_set_num_threads(self, num: int) -> None:
            pass

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Deaf())
    before = torch.get_num_threads()
    assert _on_a_new_thread(before + 1) == (False, before)


def test_no_openmp_runtime_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: object) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert _on_a_new_thread(1) == (False, torch.get_num_threads())


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bound_below_one_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=f"num_threads must be positive, got {bad}"):
        limit_intra_op_threads(bad)
