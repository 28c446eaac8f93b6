"""Disk tier bandwidth: worker stores/loads through the disk tier vs raw sequential I/O.

For each slot shape and I/O mode (direct, page cache), one transfer moves about
`--total-mib` MiB between CPU "engine" tensors and the disk tier (scattered engine blocks
↔ a set of consecutive slots, as a fresh tier would allocate them), through the public
worker API (submit + flush + poll). The baseline, measured in the same process and
interleaved with the transfers, is large sequential O_DIRECT writes/reads (8 MiB calls
from one aligned buffer) of the same number of bytes to a separate file in the same
directory. A contiguous `copy_` of the same bytes is timed too: the staged path copies and
checksums every byte on the CPU, so where memory is barely faster than the disk (small VMs)
it cannot keep pace with raw I/O. Ratios are baseline time / transfer time per repetition
(the order of each pair alternates; dirty pages are synced before every timed call).
Target (BENCHMARKS.md): >= 0.8x.

    python benchmarks/bench_disk.py [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bench_common import (
    add_copy_threads,
    existing_dir,
    new_parser,
    output_file,
    positive_int,
    write_json,
)
from kvtier.offload.plan import Tier, TransferJob, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.transfer import OffloadWorker, TensorLayout, WorkerConfig

SEQ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Row:
    """One (slot shape, mode) result; GB/s from medians, ratios baseline/op per rep."""

    mode: str
    slot_kib: int
    regions: int
    slots: int
    memcpy_gbs: float  # one contiguous copy_ of the same bytes: the machine's copy speed
    seq_write_gbs: float
    seq_read_gbs: float
    store_gbs: float
    load_gbs: float
    store_ratio: float
    load_ratio: float
    store_ratio_spread: tuple[float, float]
    load_ratio_spread: tuple[float, float]


class SequentialBaseline:
    """Large sequential direct-I/O writes and reads of `nbytes` to a scratch file."""

    def __init__(self, directory: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self.path = os.path.join(directory, "bench-sequential.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.buffer = mmap.mmap(-1, SEQ_CHUNK)
        self.buffer.write(os.urandom(SEQ_CHUNK))

    def write(self) -> None:
        for offset in range(0, self.nbytes, SEQ_CHUNK):
            size = min(SEQ_CHUNK, self.nbytes - offset)
            assert os.pwrite(self.fd, memoryview(self.buffer)[:size], offset) == size

    def read(self) -> None:
        for offset in range(0, self.nbytes, SEQ_CHUNK):
            size = min(SEQ_CHUNK, self.nbytes - offset)
            assert os.preadv(self.fd, [memoryview(self.buffer)[:size]], offset) == size

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


@dataclass(frozen=True)
class Shape:
    """What one transfer moves: `num` slots of `slot_bytes` over `regions` regions."""

    slot_bytes: int
    regions: int
    num: int
    batch_bytes: int  # the worker's disk_batch_bytes
    copy_threads: int | None  # the worker's copy_threads


class DiskCase:
    """Engine tensors and a worker whose disk tier holds `shape.num` slots."""

    def __init__(self, directory: str, mode: DiskIOMode, shape: Shape) -> None:
        num = shape.num
        self.kv = [
            torch.randint(
                0, 256, (2 * num + 1, shape.slot_bytes // shape.regions), dtype=torch.uint8
            )
            for _ in range(shape.regions)
        ]
        cfg = WorkerConfig(
            disk_num_slots=num,
            disk_path=directory,
            disk_io_mode=mode,
            disk_batch_bytes=max(shape.batch_bytes, shape.slot_bytes),
            copy_threads=shape.copy_threads,
        )
        self.worker = OffloadWorker(cfg)
        self.worker.register(self.kv, TensorLayout.BLOCKS_FIRST)
        rng = np.random.default_rng(0)
        self.blocks = rng.permutation(np.arange(1, 2 * num + 1))[:num].tolist()
        self.slots = rng.permutation(num).tolist()
        self.event_id = 0

    def run(self, src: Tier, dst: Tier, src_ids: list[int], dst_ids: list[int]) -> None:
        self.event_id += 1
        job = TransferJob(self.event_id, src, dst, tuple(src_ids), tuple(dst_ids))
        self.worker.submit(TransferPlan(self.event_id, jobs=(job,)))
        self.worker.flush()
        report = self.worker.poll()
        assert dict(report.done) == {self.event_id: 1}, report

    def store(self) -> None:
        self.run(Tier.GPU, Tier.DISK, self.blocks, self.slots)

    def load(self) -> None:
        self.run(Tier.DISK, Tier.GPU, self.slots, self.blocks[::-1])


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_config(
    directory: str, mode: DiskIOMode, slot_kib: int, regions: int, args: argparse.Namespace
) -> Row:
    slot_bytes = slot_kib << 10
    num = max(4, (args.total_mib << 20) // slot_bytes)
    nbytes = num * slot_bytes
    shape = Shape(slot_bytes, regions, num, args.batch_mib << 20, args.copy_threads)
    case = DiskCase(directory, mode, shape)
    seq = SequentialBaseline(directory, nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)

    def memcpy() -> None:
        dst.copy_(src)

    fns = {
        "seq_write": seq.write,
        "store": case.store,
        "seq_read": seq.read,
        "load": case.load,
        "memcpy": memcpy,
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    try:
        for fn in fns.values():  # warm-up; also writes every slot before the first load
            fn()
        for rep in range(args.reps):
            # Alternate which of a pair goes first, so neither always inherits the other's
            # write-back or cache state.
            order = ["seq_write", "store", "seq_read", "load", "memcpy"]
            if rep % 2:
                order = ["store", "seq_write", "load", "seq_read", "memcpy"]
            for name in order:
                os.sync()
                times[name].append(timed(fns[name]))
    finally:
        case.worker.shutdown()
        seq.close()
    store = [w / s for w, s in zip(times["seq_write"], times["store"], strict=True)]
    load = [r / s for r, s in zip(times["seq_read"], times["load"], strict=True)]
    med = {name: statistics.median(values) for name, values in times.items()}
    return Row(
        mode=mode.value,
        slot_kib=slot_kib,
        regions=regions,
        slots=num,
        memcpy_gbs=nbytes / med["memcpy"] / 1e9,
        seq_write_gbs=nbytes / med["seq_write"] / 1e9,
        seq_read_gbs=nbytes / med["seq_read"] / 1e9,
        store_gbs=nbytes / med["store"] / 1e9,
        load_gbs=nbytes / med["load"] / 1e9,
        store_ratio=statistics.median(store),
        load_ratio=statistics.median(load),
        store_ratio_spread=(min(store), max(store)),
        load_ratio_spread=(min(load), max(load)),
    )


def summarize(rows: list[Row], seconds: float) -> dict[str, float]:
    """Print the summary line and return its numbers."""
    summary: dict[str, float] = {}
    for mode in (DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE):
        for kind in ("store", "load"):
            ratios = [getattr(r, f"{kind}_ratio") for r in rows if r.mode == mode.value]
            summary[f"{mode.value}_min_{kind}_ratio"] = min(ratios)
            summary[f"{mode.value}_median_{kind}_ratio"] = statistics.median(ratios)
    summary["target"] = 0.8
    summary["seconds"] = seconds
    print(
        f"bench_disk: direct I/O store {summary['direct_min_store_ratio']:.2f}x / load "
        f"{summary['direct_min_load_ratio']:.2f}x, page cache store "
        f"{summary['page_cache_min_store_ratio']:.2f}x / load "
        f"{summary['page_cache_min_load_ratio']:.2f}x of sequential direct I/O (min over "
        f"slot shapes; target >= 0.8x); {seconds:.0f} s"
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--dir",
        type=existing_dir,
        help="directory for the files, on a filesystem with O_DIRECT (default: the system's"
        " temporary directory)",
    )
    parser.add_argument(
        "--total-mib", type=positive_int, default=128, help="MiB moved per transfer"
    )
    parser.add_argument("--reps", type=positive_int, default=8, help="interleaved repetitions")
    parser.add_argument(
        "--batch-mib",
        type=positive_int,
        default=WorkerConfig.disk_batch_bytes >> 20,
        help="the worker's staging buffer size (disk_batch_bytes) in MiB",
    )
    add_copy_threads(parser)
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    started = time.perf_counter()
    shapes = [(64, 4), (2048, 32)]  # (slot KiB, regions): small model; Llama-8B-like block
    machine = (
        f"{os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, copy_threads={args.copy_threads}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-") as directory:
        print(
            f"bench_disk: {machine}; files in {directory}; {args.total_mib} MiB per "
            f"transfer, {args.batch_mib} MiB staging buffers; median of {args.reps} "
            "interleaved reps; ratio = sequential O_DIRECT time / transfer time"
        )
        print(
            f"{'mode':>10} {'slot':>7} {'reg':>3} {'slots':>5} {'memcpy':>6} {'seq w':>6} "
            f"{'seq r':>6} "
            f"{'store GB/s':>16} {'load GB/s':>16}"
        )
        rows = []
        for mode in (DiskIOMode.DIRECT, DiskIOMode.PAGE_CACHE):
            for slot_kib, regions in shapes:
                row = run_config(directory, mode, slot_kib, regions, args)
                rows.append(row)
                print(
                    f"{row.mode:>10} {slot_kib:>5}Ki {regions:>3} {row.slots:>5} "
                    f"{row.memcpy_gbs:>6.2f} {row.seq_write_gbs:>6.2f} {row.seq_read_gbs:>6.2f} "
                    f"{row.store_gbs:>7.2f} ({row.store_ratio:4.2f}x) "
                    f"{row.load_gbs:>7.2f} ({row.load_ratio:4.2f}x)"
                )
    summary = summarize(rows, time.perf_counter() - started)
    if args.json:
        write_json(args.json, machine, args, summary, rows)


if __name__ == "__main__":
    main()
