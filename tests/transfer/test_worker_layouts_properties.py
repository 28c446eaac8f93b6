"""Round trips through the host and disk tiers over random KV layouts (SPEC §7 register).

Per-layer K/V-first caches (HND or NHD), packed allocations viewed per layer, blocks-first
caches, a hybrid of attention and state tensors of other dtypes, overlaid groups and views
with gaps between them: blocks stored to CPU and DISK, moved between the two, and loaded
into other blocks must equal what torch indexing of the original tensors gives.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transfer_helpers import fill_random, job, run_plan

from example_counts import scaled_examples
from kvtier.offload.config_fields import DiskIOMode
from kvtier.offload.plan import Tier
from kvtier.transfer import OffloadWorker, WorkerConfig
from kvtier.transfer.regions import TensorLayout

DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Layout:
    """KV tensors, the dim of each that indexes blocks, and the layout to register."""

    tensors: list[torch.Tensor]
    block_dims: list[int]
    layout: TensorLayout


def _kv_first(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    bs, h, d = block
    tensors = [torch.zeros(2, n, h, bs, d, dtype=dtype).transpose(2, 3) for _ in range(layers)]
    return Layout(tensors, [1] * layers, TensorLayout.KV_FIRST)


def _packed_layers(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    packed = torch.zeros(layers, 2, n, *block, dtype=dtype)
    return Layout([packed[i] for i in range(layers)], [1] * layers, TensorLayout.KV_FIRST)


def _packed_blocks(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    packed = torch.zeros(n, layers, 2, *block, dtype=dtype)
    tensors = [packed[:, i] for i in range(layers)]
    return Layout(tensors, [0] * layers, TensorLayout.BLOCKS_FIRST)


def _gapped(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    packed = torch.zeros(n, 3 * layers, *block, dtype=dtype)  # every third row unused
    tensors = [packed[:, 3 * i : 3 * i + 2] for i in range(layers)]
    return Layout(tensors, [0] * layers, TensorLayout.BLOCKS_FIRST)


def _hybrid(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    tensors = [torch.zeros(n, 2, *block, dtype=dtype) for _ in range(layers)]
    tensors.append(torch.zeros(n, 3 + layers, dtype=torch.float32))  # a state of its own
    return Layout(tensors, [0] * len(tensors), TensorLayout.BLOCKS_FIRST)


def _overlaid(n: int, layers: int, block: tuple[int, int, int], dtype: torch.dtype) -> Layout:
    cache = torch.zeros(n, 2, *block, dtype=dtype)
    tensors = [cache] * layers + [cache.view(torch.uint8)]  # groups sharing one cache
    return Layout(tensors, [0] * len(tensors), TensorLayout.BLOCKS_FIRST)


KINDS: tuple[Callable[[int, int, tuple[int, int, int], torch.dtype], Layout], ...] = (
    _kv_first,
    _packed_layers,
    _packed_blocks,
    _gapped,
    _hybrid,
    _overlaid,
)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    make = draw(st.sampled_from(KINDS))
    block = (draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 5, 8])))
    return make(
        draw(st.integers(1, 7)), draw(st.integers(1, 3)), block, draw(st.sampled_from(DTYPES))
    )


def block_of(layout: Layout, tensors: list[torch.Tensor], i: int, block_id: int) -> torch.Tensor:
    """Return the bytes of block `block_id` of tensor `i` (random bytes make NaNs)."""
    return tensors[i].select(layout.block_dims[i], block_id).contiguous().view(torch.uint8)


@settings(max_examples=scaled_examples(40), deadline=None)
@given(layout=layouts(), batch_bytes=st.sampled_from([1, 256, 1 << 20]), data=st.data())
def test_blocks_come_back_whole_through_every_route(
    layout: Layout, batch_bytes: int, data: st.DataObject
) -> None:
    n = layout.tensors[0].shape[layout.block_dims[0]]
    cpu_slots = data.draw(st.integers(1, 6))
    with tempfile.TemporaryDirectory() as disk_dir:
        config = WorkerConfig(
            cpu_num_slots=cpu_slots,
            disk_num_slots=6,
            disk_path=disk_dir,
            disk_io_mode=DiskIOMode.PAGE_CACHE,
            disk_batch_bytes=batch_bytes,
        )
        with OffloadWorker(config) as worker:
            worker.register(layout.tensors, layout.layout)
            fill_random(layout.tensors, seed=data.draw(st.integers(0, 2**16)))
            original = [t.clone() for t in layout.tensors]
            num = data.draw(st.integers(1, min(n, cpu_slots)))
            blocks = data.draw(st.permutations(range(n)))[:num]
            slots = data.draw(st.permutations(range(cpu_slots)))[:num]
            disk_slots = data.draw(st.permutations(range(6)))[:num]
            stored = run_plan(worker, job(1, Tier.GPU, Tier.CPU, blocks, slots))
            demoted = run_plan(worker, job(2, Tier.CPU, Tier.DISK, slots, disk_slots))
            fill_random(layout.tensors, seed=1)
            targets = data.draw(st.permutations(range(n)))[:num]
            split = data.draw(st.integers(0, num))  # the first ones from CPU, the rest from disk
            loaded = run_plan(
                worker,
                job(3, Tier.CPU, Tier.GPU, slots[:split], targets[:split]),
                job(4, Tier.DISK, Tier.GPU, disk_slots[split:], targets[split:]),
            )
    assert [r.failed for r in (stored, demoted, loaded)] == [{}, {}, {}]
    for i in range(len(layout.tensors)):
        for source, target in zip(blocks, targets, strict=True):
            expected = block_of(layout, original, i, source)
            assert torch.equal(block_of(layout, layout.tensors, i, target), expected)
