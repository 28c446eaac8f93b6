"""One corrupted disk slot fails only the load that reads it (SPEC §6.8, docs/load_failures.md).

Two requests load their prefixes from the disk tier in the same step, as one DISK -> GPU
event; one slot of the first request's prefix is corrupted on disk. Regression: the
worker failed the whole event, so both requests recomputed their 32 prefix tokens and
the scheduler dropped the keys of all 16 slots, 15 of them good copies. Then: the request
reading the bad slot recomputed its whole prefix, though the blocks loaded before the bad
one were whole; it now keeps them as its hit.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import DiskIOMode, OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
PREFIX = 32  # tokens: eight 4-token blocks per request


class CorruptOneSlot:
    """Wrap a worker: before the first DISK -> GPU job serving two requests, flip a byte
    of its source slot `index` in the slot file."""

    def __init__(self, worker: Any, index: int) -> None:
        self.worker = worker
        self.index = index
        self.job: Any = None
        self.request_ids: tuple[str, ...] = ()

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            ids = plan.load_request_ids.get(job.event_id, ())
            if self.job is None and job.src_tier is Tier.DISK and job.is_load and len(ids) == 2:
                self.job, self.request_ids = job, ids
                offset = job.src_block_ids[self.index] * self.worker.bytes_per_slot + 17
                with open(self.worker.disk_path, "r+b") as raw:
                    raw.seek(offset)
                    value = raw.read(1)[0]
                    raw.seek(offset)
                    raw.write(bytes([value ^ 0xFF]))
        self.worker.submit(plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def small_llm(tmp_path: Path | None) -> LLM:
    """Return the tiny model on 24 GPU blocks of 4 tokens, with a 4 MiB page-cache disk
    tier in `tmp_path` (None: no offload), keeping logits."""
    config = None
    if tmp_path is not None:
        config = OffloadConfig(
            disk_bytes=4 << 20, disk_path=str(tmp_path), disk_io_mode=DiskIOMode.PAGE_CACHE
        )
    engine = EngineConfig(
        block_size=4, num_gpu_blocks=24, max_num_batched_tokens=128, keep_logits=True
    )
    return LLM(ModelConfig.tiny(), kv_offload=config, engine=engine)


def serve(tmp_path: Path | None, index: int = 0) -> tuple[list[RequestOutput], Any, Any]:
    """Serve two prefixes, evict them from the GPU, then both again with new suffixes."""
    rng = random.Random(1)
    prompts = [[rng.randrange(128) for _ in range(PREFIX)] for _ in range(2)]
    fillers = [[rng.randrange(128) for _ in range(PREFIX)] for _ in range(6)]
    with small_llm(tmp_path) as llm:
        for prompt in prompts + fillers:
            llm.generate([prompt], PARAMS)
        llm.drain()
        wrap = None
        if llm.offload is not None:
            wrap = llm.offload.worker = CorruptOneSlot(llm.offload.worker, index)
        outputs = llm.generate([[*p, 5, 6, 7] for p in prompts], PARAMS)
        llm.drain()
        totals = llm.offload.totals if llm.offload is not None else None
    return outputs, wrap, totals


@pytest.mark.parametrize(
    "index",
    [0, 3, 12, 15],
    ids=["first-request", "first-request-4th", "second-request", "second-request-last"],
)
def test_a_corrupted_slot_fails_only_the_request_that_reads_it(tmp_path: Path, index: int) -> None:
    """The request reading the bad slot keeps the blocks it loaded before it (block
    `index % 8` of its prefix: 4 tokens each) and recomputes from there."""
    reference, _, _ = serve(None)
    outputs, wrap, totals = serve(tmp_path, index)
    assert wrap.job is not None, "the two prefixes never loaded in one event"
    assert len(wrap.job.src_block_ids) == 2 * PREFIX // 4
    bad_request = wrap.request_ids[index // (PREFIX // 4)]
    kept = 4 * (index % (PREFIX // 4))
    hits = {o.request_id: o.num_external_hit_tokens for o in outputs}
    assert hits == {r: kept if r == bad_request else PREFIX for r in wrap.request_ids}
    assert totals.num_failed_loads == 1
    for a, b in zip(reference, outputs, strict=True):  # never wrong KV
        assert a.output_token_ids == b.output_token_ids
        assert a.logits is not None
        assert b.logits is not None
        assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=0)
