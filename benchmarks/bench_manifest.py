"""Manifest replay: a clean log of `--records` records, and the resync across garbage.

A persistent disk tier replays its manifest at every open. This times `read_manifest`
(the median of `--reps` runs, the file hot in the page cache; wall and CPU time of this
process, user + system, which other load on the machine disturbs less) on a clean log of
`--records` records (36-byte keys, one record in ten a tombstone), and on logs of two
records with `--garbage-mib` MiB of garbage between them, which replay scans for the
second record: random bytes (a media error), zeros (a hole), and the byte 0x01 repeated
(every offset starts with a valid record kind: the most candidates by kind).

    python benchmarks/bench_manifest.py [--records 200000] [--garbage-mib 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

from bench_common import new_parser, nonnegative_int, output_file, positive_int, write_json
from kvtier.offload.plan import SlotRecord
from kvtier.storage.manifest import ManifestEntry, ManifestIdentity, read_manifest
from kvtier.storage.manifest_format import encode_put, encode_tombstone

NUM_SLOTS = 1 << 18
IDENTITY = ManifestIdentity("bench|kv|sha256:0", NUM_SLOTS, 4096, "kv:4096")


@dataclass(frozen=True)
class Row:
    """One manifest: its size, the median replay time and the live slots it recovered."""

    case: str
    mib: float
    replay_s: float
    cpu_s: float
    live: int


def records(num: int, seed: int = 0) -> list[bytes]:
    """Return `num` encoded records: puts of random keys, one in ten a tombstone."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        slot = rng.randrange(NUM_SLOTS)
        if rng.random() < 0.1:
            out.append(encode_tombstone(slot))
        else:
            key = rng.randbytes(36)
            entry = ManifestEntry(rng.getrandbits(64), SlotRecord(key, 16))
            out.append(encode_put(slot, entry))
    return out


def garbage(kind: str, size: int) -> bytes:
    """Return `size` bytes of garbage of `kind` (random, zeros or ones)."""
    if kind == "random":
        return random.Random(1).randbytes(size)
    return (b"\x00" if kind == "zeros" else b"\x01") * size


def time_replay(path: str, reps: int) -> tuple[float, float, int]:
    """Return the median wall and CPU seconds of `reps` replays of `path` and the live
    slots found."""
    walls, cpus, live = [], [], 0
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        live = len(read_manifest(path, IDENTITY))
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus), live


def run(args: argparse.Namespace, directory: str) -> list[Row]:
    """Write each case's manifest to `directory` and time its replay."""
    encoded = records(args.records)
    cases = {f"clean, {args.records} records": b"".join(encoded)}
    pair = [encode_put(slot, ManifestEntry(slot, SlotRecord(b"k" * 36, 16))) for slot in (1, 2)]
    for kind in ("random", "zeros", "ones"):
        junk = garbage(kind, args.garbage_mib << 20)
        cases[f"{args.garbage_mib} MiB {kind}"] = pair[0] + junk + pair[1]
    rows: list[Row] = []
    for case, body in cases.items():
        path = os.path.join(directory, "bench.manifest")
        with open(path, "wb") as out:
            out.write(IDENTITY.encode() + body)
        wall, cpu, live = time_replay(path, args.reps)
        mib = os.path.getsize(path) / (1 << 20)
        rows.append(Row(case, round(mib, 2), wall, cpu, live))
        print(
            f"{case:24} {mib:6.1f} MiB  wall {wall * 1e3:7.1f} ms  cpu {cpu * 1e3:7.1f} ms  "
            f"{live} live",
            flush=True,
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--records", type=positive_int, default=200_000, help="records in the manifest"
    )
    parser.add_argument(
        "--garbage-mib",
        type=nonnegative_int,
        default=8,
        help="MiB of garbage between two records (the resync cases)",
    )
    parser.add_argument("--reps", type=positive_int, default=7, help="replays per case")
    parser.add_argument("--json", type=output_file, help="write every number to this file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    logging.disable(logging.WARNING)  # the garbage cases warn at every replay
    with tempfile.TemporaryDirectory() as directory:
        rows = run(args, directory)
    clean = rows[0]
    worst = max(rows[1:], key=lambda row: row.cpu_s)
    line = (
        f"bench_manifest: Python {platform.python_version()}, {clean.case} "
        f"{clean.replay_s * 1e3:.0f} ms wall, {clean.cpu_s * 1e3:.0f} ms CPU; slowest resync "
        f"({worst.case}) {worst.replay_s * 1e3:.0f} ms wall, {worst.cpu_s * 1e3:.0f} ms CPU"
    )
    if args.json:
        write_json(args.json, platform.processor() or platform.machine(), args, line, rows)
    print(line)


if __name__ == "__main__":
    main()
