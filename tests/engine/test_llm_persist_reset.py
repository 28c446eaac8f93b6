"""A tier reset ends a persistent disk tier's persistence for the rest of the run.

A reset usually announces KV the engine can no longer trust: weights changed in memory (RL
weight sync), which leaves the files the fingerprint hashes as they were. So a reset drops
every manifest record, and nothing stored after it is recorded: a restart from the
original checkpoint (same fingerprint) restores nothing and matches a reference engine.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_llm_reset_retry import OnePollLate

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig

MODEL = ModelConfig.tiny()
BLOCK_BYTES = MODEL.kv_bytes_per_token() * 4  # block size 4
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=24, keep_logits=True)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
PROMPT = list(range(3, 3 + 21))


def persistent(tmp_path: Path, cascade: CascadeMode | None) -> OffloadConfig:
    """A persistent disk tier (page cache: tmpfs may refuse O_DIRECT), maybe behind a CPU tier."""
    return OffloadConfig(
        cpu_bytes=8 * BLOCK_BYTES if cascade is not None else 0,
        disk_bytes=32 * BLOCK_BYTES,
        disk_path=str(tmp_path),
        disk_io_mode=DiskIOMode.PAGE_CACHE,
        disk_persist=True,
        cascade=cascade or CascadeMode.WRITE_THROUGH,
    )


def reference() -> RequestOutput:
    with LLM(MODEL, None, ENGINE) as llm:
        (output,) = llm.generate([PROMPT], PARAMS)
    return output


def restart(config: OffloadConfig) -> tuple[RequestOutput, int]:
    """Serve PROMPT on an engine started from the original weights; return its output and
    the disk blocks it restored."""
    with LLM(MODEL, config, ENGINE) as llm:
        assert llm.offload is not None
        restored = llm.offload.num_restored_blocks
        (output,) = llm.generate([PROMPT], PARAMS)
    return output, restored


def update_weights(llm: LLM) -> None:
    """An in-place weight update (RL weight sync): the fingerprinted files do not change."""
    with torch.no_grad():
        for parameter in llm.runner.model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    llm.pool.discard_all_keys()


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.logits is not None
    assert want.logits is not None
    assert torch.allclose(got.logits, want.logits, atol=1e-4, rtol=0), "served wrong KV"


CASCADES = [None, CascadeMode.WRITE_THROUGH]
CASCADE_IDS = ["disk", "cpu+disk"]


@pytest.mark.parametrize("cascade", CASCADES, ids=CASCADE_IDS)
def test_kv_stored_after_a_reset_is_not_restored_by_a_restart(
    tmp_path: Path, cascade: CascadeMode | None, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression (review): the stores and demotions after the reset were recorded under
    # the start-up fingerprint; the restart restored 5 blocks of the updated weights' KV.
    want = reference()
    config = persistent(tmp_path, cascade)
    with LLM(MODEL, config, ENGINE) as llm:
        assert llm.offload is not None
        update_weights(llm)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            assert llm.offload.scheduler.reset()
            llm.generate([PROMPT], PARAMS)  # stored (and demoted) after the reset
    got, restored = restart(config)
    assert restored == 0
    assert got.num_external_hit_tokens == 0
    assert_same(got, want)
    assert "a reset dropped the persistent cache" in caplog.text


@pytest.mark.parametrize("cascade", CASCADES, ids=CASCADE_IDS)
def test_a_reset_drops_what_earlier_runs_and_this_one_persisted(
    tmp_path: Path, cascade: CascadeMode | None
) -> None:
    config = persistent(tmp_path, cascade)
    first, restored = restart(config)
    assert restored == 0
    with LLM(MODEL, config, ENGINE) as llm:
        assert llm.offload is not None
        assert llm.offload.num_restored_blocks > 0
        llm.generate([[t + 1 for t in PROMPT]], PARAMS)  # persisted before the reset
        while not llm.offload.scheduler.reset():  # retried each step, as engines do
            llm.step()
        llm.step()  # the plan that tells the worker (an empty step)
    _, restored = restart(config)
    assert restored == 0
    again, restored = restart(config)  # persistence is back in a run without a reset
    assert restored > 0
    assert again.num_external_hit_tokens > 0
    assert_same(again, first)


def test_a_reset_that_returns_false_ends_persistence_too(tmp_path: Path) -> None:
    """A caller may ignore the False (vLLM's reset_prefix_cache returns a bool): the keys
    are dropped at once, and so is the persistent cache; the copies then in flight, stored
    from the old weights, complete after it and are not recorded either."""
    want = reference()
    config = persistent(tmp_path, CascadeMode.WRITE_THROUGH)
    with LLM(MODEL, config, ENGINE) as llm:
        assert llm.offload is not None
        llm.offload.worker = OnePollLate(llm.offload.worker)  # type: ignore[assignment]
        llm.generate([PROMPT], PARAMS)
        update_weights(llm)
        assert not llm.offload.scheduler.reset()  # never retried
        llm.generate([PROMPT], PARAMS)
    got, restored = restart(config)
    assert restored == 0
    assert_same(got, want)


CRASH_AFTER_RESET = """
import os, sys
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.offload.config import DiskIOMode, OffloadConfig

config = OffloadConfig(disk_bytes={disk_bytes}, disk_path={path!r},
                       disk_io_mode=DiskIOMode.PAGE_CACHE, disk_persist=True)
llm = LLM(ModelConfig.tiny(), config, EngineConfig(block_size=4, num_gpu_blocks=24))
assert llm.offload is not None and llm.offload.num_restored_blocks > 0
assert llm.reset_prefix_cache()
sys.stdout.flush()
os._exit(0)  # a crash right after the reset returned
"""


def test_a_reset_is_durable_when_it_returns(tmp_path: Path) -> None:
    """Regression (review): the manifest was emptied with the next step's plan or at
    shutdown, so a crash right after a reset restored the cache from before it."""
    config = persistent(tmp_path, None)
    with LLM(MODEL, config, ENGINE) as llm:
        llm.generate([PROMPT], PARAMS)
    script = CRASH_AFTER_RESET.format(disk_bytes=config.disk_bytes, path=str(tmp_path))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    got, restored = restart(config)
    assert restored == 0
    assert got.num_external_hit_tokens == 0


def test_reset_prefix_cache_drops_the_gpu_cache_and_waits_for_unfinished_requests() -> None:
    llm = LLM(MODEL, None, ENGINE)
    llm.generate([PROMPT], PARAMS)
    request = llm.add_request(PROMPT, PARAMS)
    assert not llm.reset_prefix_cache()  # it would keep computing on the old prefix
    while llm.scheduler.has_unfinished():
        llm.step()
    assert request.num_local_tokens_total == 20  # the GPU cache was kept
    assert llm.reset_prefix_cache()
    (output,) = llm.generate([PROMPT], PARAMS)
    assert output.num_local_hit_tokens == 0
