"""Disk transfers still queued when the interpreter starts to exit: a `shutdown()` run by
an atexit callback (or an engine's exit-time cleanup) finishes them, as it would before.

Regression: the disk tier's I/O threads were `ThreadPoolExecutor` workers, which Python
stops before any atexit callback runs (`threading._register_atexit`). Every disk job
still queued then failed with "cannot schedule new futures after shutdown", its store
lost (a persistent tier's cache with it), and nobody left to see the failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

_SCRIPT = """
import atexit, sys, threading
sys.path.insert(0, sys.argv[1])
from transfer_helpers import FaultyIO, fill_random, job, kv_per_layer, make_worker, run_plan
from kvtier.offload.plan import Tier, TransferPlan
from kvtier.storage import DiskIOMode
from kvtier.transfer import WorkerConfig

kv = kv_per_layer(2, 16, (4, 2, 8))
fill_random(kv, seed=3)
io = FaultyIO()
config = WorkerConfig(
    cpu_num_slots=8, disk_num_slots=8, disk_path=sys.argv[2],
    disk_io_mode=DiskIOMode.PAGE_CACHE,
)
worker = make_worker(config, kv, io)
assert dict(run_plan(worker, job(1, Tier.GPU, Tier.DISK, [1], [1])).done) == {1: 1}

def shut_down():
    worker.shutdown()
    report = worker.poll()
    with open(sys.argv[3], "w") as out:
        out.write(f"{sorted(report.done)} {sorted(report.failed)}")

atexit.register(shut_down)
io.gate.clear()  # the first write waits: the other jobs are queued at exit
stores = [job(e, Tier.GPU, Tier.DISK, [e], [e]) for e in range(2, 6)]
load = job(6, Tier.DISK, Tier.GPU, [1], [9])
worker.submit(TransferPlan(step_id=1, jobs=(*stores, load)))
threading.Timer(0.5, io.gate.set).start()
"""


def test_a_shutdown_at_exit_finishes_the_queued_disk_transfers(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(_SCRIPT)
    result = tmp_path / "report"
    disk = tmp_path / "disk"
    disk.mkdir()
    here = str(Path(__file__).parent)
    subprocess.run(
        [sys.executable, str(script), here, str(disk), str(result)], check=True, timeout=60
    )
    assert result.read_text() == "[2, 3, 4, 5, 6] []"
    assert list(disk.iterdir()) == []  # the slot file was removed
