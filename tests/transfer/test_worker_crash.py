"""A persistent disk tier survives its process being killed at any moment.

A child process (`crash_writer.py`) keeps storing blocks into a persistent disk tier,
through the CPU tier too, with rewrites without records and a manifest compacting every
few dozen records. It dies by SIGKILL: at a chosen point (half-way through writing slot
bytes, between the bytes and their record, between a compacted manifest and its rename)
or wherever the test's kill finds it. The test then reopens the tier in this process and
loads every recovered slot: a load must return exactly the bytes of the recovered
record's key (wrong bytes under a key are the one outcome a cache must never produce).
Nor may it fail: a slot's record is dropped before its bytes are overwritten, so no record
describes bytes that changed after it (the checksum would catch them, and the engine
recompute them, but the restart should simply miss them). Each child continues on what
the previous one left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crash_writer import (
    NUM_GPU_BLOCKS,
    config,
    key_id_of,
    key_image,
    new_kv,
)
from transfer_helpers import job, run_plan

from kvtier.offload.plan import Tier
from kvtier.transfer import OffloadWorker
from kvtier.transfer.regions import TensorLayout

pytestmark = pytest.mark.timeout(180)

WRITER = Path(__file__).with_name("crash_writer.py")


def run_writer_until_killed(directory: Path, seed: int, kill_point: str, num_jobs: int) -> None:
    """Run a writer on `directory` until it dies by SIGKILL: at `kill_point` after
    `num_jobs` jobs, or (`none`) by this test's kill once it reported `num_jobs` jobs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WRITER.parent), *sys.path])}
    args = [sys.executable, str(WRITER), str(directory), str(seed), kill_point, str(num_jobs)]
    child = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        for lines, _ in enumerate(child.stdout):
            if kill_point == "none" and lines > num_jobs:
                child.send_signal(signal.SIGKILL)
                break
        _, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL, f"writer ended otherwise:\n{stderr}"


def check_recovered(directory: Path) -> tuple[int, int]:
    """Load every recovered slot; return (loads with the right bytes, loads refused)."""
    kv = new_kv()
    right = refused = 0
    with OffloadWorker(config(str(directory))) as worker:
        worker.register(kv, TensorLayout.KV_FIRST)
        recovered = worker.recovered_slots()
        for event, (slot, record) in enumerate(recovered, start=1):
            block_id = NUM_GPU_BLOCKS - 1
            report = run_plan(worker, job(event, Tier.DISK, Tier.GPU, [slot], [block_id]))
            if dict(report.failed):
                refused += 1
                continue
            assert dict(report.done) == {event: 1}
            expected = key_image(key_id_of(record.key))
            for layer, image in zip(kv, expected, strict=True):
                assert torch.equal(layer[:, block_id], image), (
                    f"slot {slot} loaded bytes that are not those of its record's key"
                )
            right += 1
    return right, refused


# The writer aims its armed store at slots that hold a record (with seed 2 it once hit a
# slot whose record a rewrite without records had dropped, testing nothing stale).
@pytest.mark.parametrize("seed", [0, 2])
def test_killed_writer_never_leaves_a_slot_that_loads_wrong_bytes(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    total_right = 0
    for kill_point in ("write", "none", "compaction", "record"):
        run_writer_until_killed(tmp_path, rng.randrange(1 << 30), kill_point, rng.randint(30, 300))
        right, refused = check_recovered(tmp_path)
        total_right += right
        # A slot's record is tombstoned before the slot is overwritten (its block evicted,
        # the slot reused), so even the job the kill interrupted leaves no record over
        # other bytes: every recovered slot loads.
        assert refused == 0, f"{kill_point}: {refused} slots failed verification"
    assert total_right > 0, "no recovered slot was ever loaded: the test checked nothing"
