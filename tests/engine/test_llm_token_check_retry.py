"""Token check on: a request retried after a failed load must note its new local prefix.

Regression (review): the engine re-admitted a request whose load failed without a
lookup (`skip_external`), so the offload scheduler kept the local prefix of the FIRST
lookup as the request's fill floor. The retry got a longer local prefix from the GPU
cache, blocks filled by another request whose tokens collide in the block hash; the
request tagged them as its own fills and stored them, so the tier held the other
tokens' KV under a tag that passes the check, and a later request was served wrong KV.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_llm_token_check import weak_hash_block

from kvtier.core.hashing import BlockHasher
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import Tier, TransferPlan, WorkerReport

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


class HeldLoads:
    """A synchronous worker whose load reports are held while `hold`, then failed if `fail`."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.loads: set[int] = set()
        self.held: dict[int, int] = {}
        self.hold = False
        self.fail = False

    def submit(self, plan: TransferPlan) -> None:
        self.loads.update(job.event_id for job in plan.jobs if job.dst_tier is Tier.GPU)
        self.worker.submit(plan)
        self.worker.flush()

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        done = dict(report.done)
        if self.hold:
            for event_id in [e for e in done if e in self.loads]:
                self.held[event_id] = done.pop(event_id)
        failed = dict(report.failed)
        if not self.hold:
            (failed if self.fail else done).update(self.held)
            self.held.clear()
        return WorkerReport(done=done, failed=failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def run_until_finished(llm: LLM, request: Request) -> None:
    for _ in range(500):
        if request.status is RequestStatus.FINISHED:
            return
        llm.step()
    raise AssertionError(f"{request.request_id} never finished")


def test_a_retry_after_a_failed_load_never_tags_another_requests_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BlockHasher, "hash_block", weak_hash_block)
    rng = random.Random(3)
    b = [rng.randrange(28) for _ in range(12)]
    a = [t + 100 for t in b]  # collides with B in every block
    fillers = [[rng.randrange(28, 100) for _ in range(20)] for _ in range(3)]
    engine = EngineConfig(block_size=4, num_gpu_blocks=16, keep_logits=True)
    with LLM(ModelConfig.tiny(), None, engine) as reference:
        (want,) = reference.generate([[*b, 5, 6]], PARAMS)
    llm = LLM(ModelConfig.tiny(), OffloadConfig(cpu_bytes=1 << 20, token_check=True), engine)
    try:
        assert llm.offload is not None
        worker = HeldLoads(llm.offload.worker)
        llm.offload.worker = worker  # type: ignore[assignment]
        llm.generate([[*b, 1]], PARAMS)  # B's blocks reach the tier, tagged with B
        for filler in fillers:
            llm.generate([filler], PARAMS)  # and leave the GPU cache
        llm.drain()
        worker.hold = True
        retried = llm.add_request([*b, 1, 2, 3, 4], PARAMS)  # hits B's blocks in the tier
        for _ in range(3):
            llm.step()
        assert retried.status is RequestStatus.WAITING_FOR_LOAD
        other = llm.add_request([*a, 7], PARAMS)  # misses (tags differ), computes A's KV
        run_until_finished(llm, other)  # A's KV now in the GPU cache under B's keys
        worker.hold, worker.fail = False, True  # the load fails: the retry's local
        run_until_finished(llm, retried)  # prefix is A's blocks (the GPU cache has no check)
        worker.fail = False
        for filler in fillers:
            llm.generate([filler], PARAMS)
        llm.drain()
        (got,) = llm.generate([[*b, 5, 6]], PARAMS)
        llm.offload.scheduler.check_invariants()
    finally:
        llm.shutdown()
    assert got.num_external_hit_tokens == 0, "A's KV was stored under B's tag"
    assert got.output_token_ids == want.output_token_ids
    assert got.logits is not None
    assert want.logits is not None
    assert torch.allclose(got.logits, want.logits, atol=1e-4, rtol=0)
