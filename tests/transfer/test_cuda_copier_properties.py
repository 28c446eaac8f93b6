"""The CUDA copier's byte logic against torch indexing, on the CPU (streams faked).

Random region widths (strided engine views included), repeated sources, ids in any
order and chunk sizes down to one row: every copy must equal the row-by-row reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from example_counts import scaled_examples
from kvtier.transfer import copiers
from kvtier.transfer.copiers import CudaCopier, StagingRows


class _Stream:
    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def fake_cuda(chunk_bytes: int) -> Iterator[CudaCopier]:
    """Yield a CudaCopier whose "device" is the CPU and whose chunks hold `chunk_bytes`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copiers, "lowest_priority_stream", lambda device: _Stream())
        patch.setattr(copiers, "_DEVICE_CHUNK_BYTES", chunk_bytes)
        patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        patch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        patch.setattr(torch.Tensor, "pin_memory", lambda self: self)
        yield CudaCopier(torch.device("cpu"))


@dataclass(frozen=True)
class Case:
    """Engine regions, host regions (same widths), and how many blocks to copy."""

    engine: list[torch.Tensor]
    host: list[torch.Tensor]
    num: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_blocks, num_slots = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    widths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    engine = []
    for width in widths:
        pad = draw(st.integers(0, 2))  # a strided engine view: rows wider than the region
        full = torch.randint(0, 2**40, (num_blocks, width + pad), generator=gen)
        engine.append(full[:, pad : pad + width])
    host = [torch.randint(0, 2**40, (num_slots, w), generator=gen) for w in widths]
    num = draw(st.integers(0, min(num_blocks, num_slots)))
    return Case(engine, host, num)


def draw_ids(data: st.DataObject, num: int, size: int, distinct: bool) -> np.ndarray:
    if distinct:
        ids = data.draw(st.permutations(range(size)))[:num]
    else:
        ids = data.draw(st.lists(st.integers(0, size - 1), min_size=num, max_size=num))
    return np.array(ids, dtype=np.int64)


CHUNKS = st.sampled_from([1, 8, 40, 1 << 20])


@pytest.mark.parametrize("direction", ["store", "load"])
@settings(max_examples=scaled_examples(80), deadline=None)
@given(case=cases(), chunk=CHUNKS, data=st.data())
def test_copy_matches_row_by_row(
    direction: str, case: Case, chunk: int, data: st.DataObject
) -> None:
    """store: engine rows to host slots; load: host slots to engine rows."""
    sources, targets = (
        (case.engine, case.host) if direction == "store" else (case.host, case.engine)
    )
    src = draw_ids(data, case.num, sources[0].shape[0], distinct=False)
    dst = draw_ids(data, case.num, targets[0].shape[0], distinct=True)
    expected = [t.clone() for t in targets]
    for source, x in zip(sources, expected, strict=True):
        x[dst] = source[src]
    with fake_cuda(chunk) as copier:
        getattr(copier, direction)(sources, src, targets, dst)
    assert all(torch.equal(t, x) for t, x in zip(targets, expected, strict=True))


@settings(max_examples=scaled_examples(60), deadline=None)
@given(case=cases(), data=st.data())
def test_staging_round_trip_matches_row_by_row(case: Case, data: st.DataObject) -> None:
    engine, num = case.engine, case.num
    spans, start = [], 0
    for view in engine:
        spans.append((start, start + view.shape[1]))
        start += view.shape[1]
    staging = StagingRows.of(torch.full((num + 2, start), -1, dtype=torch.int64), spans)
    src = draw_ids(data, num, engine[0].shape[0], distinct=False)
    dst = draw_ids(data, num, engine[0].shape[0], distinct=True)
    gathered = torch.cat([e[src] for e in engine], dim=1)
    expected = [e.clone() for e in engine]
    for x, (a, b) in zip(expected, spans, strict=True):
        x[dst] = gathered[:, a:b]
    with fake_cuda(1 << 20) as copier:
        copier.store_to_staging(engine, src, staging)
        assert torch.equal(staging.rows[:num], gathered)
        assert bool((staging.rows[num:] == -1).all()), "rows past the batch were written"
        copier.load_from_staging(staging, engine, dst)
    assert all(torch.equal(e, x) for e, x in zip(engine, expected, strict=True))
