"""A copy crew's smaller promises: exact shares, its size and thread limits, one scratch
per thread, and failures of any kind waited for.

Each test here was written against a mutant that passed every older test (s33 mutation
run on `transfer/copy_crew.py`).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier.transfer.copy_crew as copy_crew
from kvtier.transfer.block_copy import CopyStrategy, plan_copy
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy, crew_size, share_out


def _helper_names(crew_name: str) -> set[str]:
    prefix = f"kvtier-{crew_name}-copy"
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix)}


def _spy_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, CopyStrategy, object]]:
    """Record (thread name, strategy, scratch) for every share copied."""
    seen: list[tuple[str, CopyStrategy, object]] = []
    copy_rows = copy_crew.copy_rows

    def spying(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        seen.append((threading.current_thread().name, plan.strategy, scratch))
        copy_rows(plan, src, dst, a, b, scratch)

    monkeypatch.setattr(copy_crew, "copy_rows", spying)
    return seen


def test_rows_that_divide_evenly_are_shared_exactly() -> None:
    """A share ends where its bytes reach its bound: 8 equal rows in 2 shares are 4 and
    4, each one piece (a share that went on past its bound took a row of the next)."""
    assert share_out([(8, 10)], 2) == [[(0, 0, 4)], [(0, 4, 8)]]
    assert share_out([(4, 10), (4, 10)], 4) == [
        [(0, 0, 2)],
        [(0, 2, 4)],
        [(1, 0, 2)],
        [(1, 2, 4)],
    ]


def test_the_default_crew_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left open, a crew takes torch's intra-op thread count but never more than
    MAX_DEFAULT_SIZE: more threads only take cores from the engine."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert crew_size(None) == copy_crew.MAX_DEFAULT_SIZE
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert crew_size(None) == 1


@pytest.mark.parametrize("size", [True, 0, -1, 2.0])
def test_a_crew_size_that_is_not_a_positive_int_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match=f"positive number of threads, got {size!r}"):
        CopyCrew(size, "bad")  # type: ignore[arg-type]


def test_max_threads_above_the_crew_size_uses_the_crew(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run(max_threads=...)` past the crew's size is capped at it: the batch is split
    over the crew's own threads and copied whole."""
    seen = _spy_threads(monkeypatch)
    crew = CopyCrew(2, "cap", min_share_bytes=1)
    src = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
    dst = np.zeros_like(src)
    try:
        crew.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 32), src, dst)], 5)
    finally:
        crew.close()
    assert np.array_equal(dst, src)
    assert len({name for name, _, _ in seen}) == 2


def test_a_small_batch_stays_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch under `min_share_bytes` a thread is not worth a hand-off: the calling
    thread copies it all and no helper starts."""
    seen = _spy_threads(monkeypatch)
    crew = CopyCrew(4, "small", min_share_bytes=1 << 20)
    src = np.arange(64 * 512, dtype=np.int64).reshape(64, 512)  # 256 KiB
    dst = np.zeros_like(src)
    try:
        crew.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 4096), src, dst)])
        assert _helper_names("small") == set()
    finally:
        crew.close()
    assert np.array_equal(dst, src)
    assert {name for name, _, _ in seen} == {threading.current_thread().name}


def test_a_member_with_an_empty_share_starts_no_thread() -> None:
    """Two large rows over a crew of four leave two shares empty: only the member whose
    share holds a row gets a helper thread."""
    crew = CopyCrew(4, "empty", min_share_bytes=1)
    src = np.arange(2 * 4096, dtype=np.int64).reshape(2, 4096)
    dst = np.zeros_like(src)
    shares = share_out([(2, 4096 * 8)], 4)
    assert [bool(share) for share in shares] == [True, False, True, False]
    try:
        crew.run([RegionCopy(plan_copy(np.arange(2), np.arange(2), 4096 * 8), src, dst)])
        assert _helper_names("empty") == {"kvtier-empty-copy2"}
    finally:
        crew.close()
    assert np.array_equal(dst, src)


def test_each_thread_stages_in_its_own_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shares of a scratch plan run at once: two threads staging rows in one scratch
    would overwrite each other's rows before they are scattered."""
    seen = _spy_threads(monkeypatch)
    rng = np.random.default_rng(3)
    src_ids, dst_ids = rng.permutation(512)[:256], rng.permutation(512)[:256]
    src = rng.integers(0, 2**62, (512, 16))
    dst = np.zeros_like(src)
    plan = plan_copy(src_ids, dst_ids, 128)
    assert plan.strategy is CopyStrategy.SCRATCH
    crew = CopyCrew(3, "scratch", min_share_bytes=1)
    try:
        crew.run([RegionCopy(plan, src, dst)])
    finally:
        crew.close()
    assert np.array_equal(dst[dst_ids], src[src_ids])
    scratch_of = {name: id(scratch) for name, _, scratch in seen}
    assert len(scratch_of) == 3
    assert len(set(scratch_of.values())) == 3


class _NotAnException(BaseException):
    """An error that `except Exception` lets through (as KeyboardInterrupt is)."""


def test_an_interrupt_of_the_lanes_share_waits_for_the_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt in the calling thread's share is raised only once the
    helper's share stopped: no copy may run on into blocks handed on since."""
    helper_done = threading.Event()

    def copy_rows(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("kvtier-ctrlc-copy"):
            time.sleep(0.2)
            helper_done.set()
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr(copy_crew, "copy_rows", copy_rows)
    crew = CopyCrew(2, "ctrlc", min_share_bytes=1)
    src = np.zeros((8, 4), dtype=np.int64)
    try:
        with pytest.raises(KeyboardInterrupt):
            crew.run([RegionCopy(plan_copy(np.arange(8), np.arange(8), 32), src, src.copy())])
        assert helper_done.is_set()
    finally:
        crew.close()


def test_a_helper_error_that_is_no_exception_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper's share raising a BaseException is still reported to `run`, which
    raises it: a helper that died of it instead would leave `run` waiting for good."""

    def copy_rows(plan, src, dst, a, b, scratch):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("kvtier-base-copy"):
            raise _NotAnException("helper share")

    monkeypatch.setattr(copy_crew, "copy_rows", copy_rows)
    crew = CopyCrew(2, "base", min_share_bytes=1)
    src = np.zeros((8, 4), dtype=np.int64)
    plan = plan_copy(np.arange(8), np.arange(8), 32)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            crew.run([RegionCopy(plan, src, src.copy())])
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=10)
    assert not runner.is_alive(), "run() still waits for a helper that died"
    crew.close()
    assert len(raised) == 1
    assert isinstance(raised[0], _NotAnException)


_EXIT_WITHOUT_CLOSE = """
import numpy as np
from kvtier.transfer.block_copy import plan_copy
from kvtier.transfer.copy_crew import CopyCrew, RegionCopy

crew = CopyCrew(3, "left", min_share_bytes=1)
src = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
crew.run([RegionCopy(plan_copy(np.arange(64), np.arange(64), 32), src, src.copy())])
# No close(): the helpers wait on their queues while the interpreter exits.
"""


def test_an_unclosed_crew_does_not_keep_the_interpreter_alive(tmp_path: Path) -> None:
    """Helpers are daemon threads: a process that never closed its crew still exits."""
    script = tmp_path / "left.py"
    script.write_text(_EXIT_WITHOUT_CLOSE)
    subprocess.run([sys.executable, str(script)], check=True, timeout=30)
