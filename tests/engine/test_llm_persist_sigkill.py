"""An engine process killed (SIGKILL) in the middle of appending to its persistent disk
tier's manifest: a restart on the same directory keeps the records appended before, and
serves what an engine without offloading computes.

A real kill, not a copy of the files: the engine's I/O threads, its file lock and a
group commit are cut short where they are. The child tears its second manifest append
(half its bytes reach the file) and kills itself.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import DiskIOMode, OffloadConfig

MODEL = ModelConfig.tiny()
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=24, keep_logits=True)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 120 + 1 for j in range(21)] for i in range(3)]

KILLED_MID_APPEND = """
import os, signal
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import DiskIOMode, OffloadConfig

write = os.write
appends = 0

def tearing_write(fd, data):
    global appends
    if os.readlink(f"/proc/self/fd/{{fd}}").endswith(".manifest"):
        appends += 1
        if appends == 2:
            write(fd, bytes(data)[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    return write(fd, data)

os.write = tearing_write
config = OffloadConfig(disk_bytes={disk_bytes}, disk_path={path!r},
                       disk_io_mode=DiskIOMode.PAGE_CACHE, disk_persist=True)
llm = LLM(ModelConfig.tiny(), config, EngineConfig(block_size=4, num_gpu_blocks=24))
for prompt in {prompts!r}:
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
"""


def persistent(path: Path) -> OffloadConfig:
    """A persistent disk tier of 32 blocks (page cache: tmpfs may refuse O_DIRECT)."""
    return OffloadConfig(
        disk_bytes=32 * MODEL.kv_bytes_per_token() * 4,
        disk_path=str(path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
    )


def serve(config: OffloadConfig | None) -> tuple[list[RequestOutput], int]:
    """Serve PROMPTS one by one; return the outputs and the disk blocks restored."""
    with LLM(MODEL, config, ENGINE) as llm:
        restored = 0 if llm.offload is None else llm.offload.num_restored_blocks
        return [llm.generate([p], PARAMS)[0] for p in PROMPTS], restored


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_kill_tearing_a_manifest_append_keeps_the_records_before_it(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    script = KILLED_MID_APPEND.format(
        disk_bytes=config.disk_bytes, path=str(tmp_path), prompts=PROMPTS
    )
    child = subprocess.run([sys.executable, "-c", script], timeout=120, check=False)
    assert child.returncode == -signal.SIGKILL, "the child was not killed at its 2nd append"
    want, _ = serve(None)
    got, restored = serve(config)
    assert restored > 0, "the records appended before the torn one were lost"
    assert got[0].num_external_hit_tokens > 0
    for g, w in zip(got, want, strict=True):
        assert g.output_token_ids == w.output_token_ids
        assert g.logits is not None
        assert w.logits is not None
        assert torch.allclose(g.logits, w.logits, atol=1e-4, rtol=0), "served wrong KV"
