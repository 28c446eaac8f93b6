"""A disk tier left open at interpreter exit: its I/O threads (daemons since they must keep
working through atexit callbacks) finish the queued writes before its finalizer closes
the files, so no write lands on a closed (or reused) descriptor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import os, sys, time
import numpy as np
from kvtier.storage import DiskIOMode
from kvtier.storage.disk_tier import DiskTier, DiskTierConfig

class SlowIO:
    def pwrite(self, fd, data, offset):
        time.sleep(0.3)  # the writes are still queued when the interpreter exits
        return os.pwrite(fd, data, offset)

    def pread(self, fd, into, offset):
        return os.preadv(fd, [into], offset)

path = os.path.join(sys.argv[1], "t.slots")
config = DiskTierConfig(path, num_slots=8, bytes_per_slot=4096, io_mode=DiskIOMode.PAGE_CACHE)
tier = DiskTier(config, SlowIO())
outcomes = []
for i, buffer in enumerate(tier.store_buffers):
    buffer.tensor.fill_(i + 1)
    future = tier.write_slots(buffer, np.array([i]))
    future.add_done_callback(lambda f: outcomes.append(repr(f.exception())))

def report():
    with open(sys.argv[2], "w") as out:
        out.write(" ".join(outcomes))

import atexit, weakref
atexit.register(report)  # runs after the finalizers: registered before their hook
atexit.unregister(weakref.finalize._exitfunc)
atexit.register(weakref.finalize._exitfunc)
"""


def test_a_tier_open_at_exit_finishes_its_queued_writes_before_closing(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(_SCRIPT)
    result = tmp_path / "outcomes"
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run([sys.executable, str(script), str(disk), str(result)], check=True, timeout=30)
    assert result.read_text() == "None None"
    assert list(disk.iterdir()) == []  # closed (and removed) at collection
