"""A corrupted disk slot through vLLM's real scheduler: the request keeps its good prefix.

Two requests load their 64-token prefixes (four 16-token blocks each) from the disk tier
in one DISK -> GPU event; one rank finds the slot at block `block` of one request's part
corrupted. With one full-attention group the worker reports that request finished and
the GPU block the bad slot was copied into as a load error
(`get_block_ids_with_load_errors`): vLLM truncates the request at that block, keeps the
`16 * block` tokens before it and recomputes from there; the other request keeps its
whole hit. The harness checks every kept position's KV (a kept bad block raises
`KVMismatchError`) and the outputs equal those of a run without the fault.
Regression: the request was reported in `failed_recving`, so vLLM recomputed all 64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier_vllm import (
    SCHEDULING,
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    offload_worker,
)
from vllm_engine import KVGroupDef
from vllm_harness import VllmHarness, shared_prefix_prompts

from kvtier.offload.plan import Tier, TransferPlan

PREFIX = 64  # tokens per request's prefix
BLOCKS = PREFIX // 16  # blocks of it (the harness model's 16-token blocks)


class CorruptSlot:
    """Wrap a rank's `OffloadWorker.submit`: before the first DISK -> GPU job serving two
    requests, flip byte `byte` of the slot at `block` of request `which`'s part on disk
    (byte 0 is a fingerprint byte: the harness would see it served). Records the slot,
    the GPU block it loads into and the job's request ids."""

    def __init__(self, worker: Any, which: int, block: int = 0, byte: int = 17) -> None:
        self.worker = worker
        self.which = which
        self.block = block
        self.byte = byte
        self._submit = worker.submit
        worker.submit = self.submit
        self.request_ids: tuple[str, ...] = ()
        self.slot: int | None = None
        self.gpu_block: int | None = None

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            ids = plan.load_request_ids.get(job.event_id, ())
            if self.slot is None and job.src_tier is Tier.DISK and len(ids) == 2:
                assert job.is_load
                assert len(job.load_parts) == 2
                self.request_ids = ids
                index = sum(job.load_parts[: self.which]) + self.block  # in request order
                self.slot, self.gpu_block = job.src_block_ids[index], job.dst_block_ids[index]
                offset = self.slot * self.worker.bytes_per_slot + self.byte
                with open(self.worker.disk_path, "r+b") as raw:
                    raw.seek(offset)
                    value = raw.read(1)[0]
                    raw.seek(offset)
                    raw.write(bytes([value ^ 0xFF]))
        self._submit(plan)


def serve(
    tmp_path: Path, num_ranks: int, fault: tuple[int, int] | None, **overrides: Any
) -> tuple[VllmHarness, dict[str, int], dict[str, list[int]], CorruptSlot | None]:
    """Store two prefixes on disk, drop vLLM's GPU copies, serve both again (corrupting
    one slot of the load when `fault` = (which request, which block of its part));
    return the harness, each request's computed tokens when it was first scheduled to
    run, its output tokens, and the corrupter. `overrides`: harness config fields."""
    extra = {"cpu_bytes": 0, "disk_bytes": 256 * SLOT_BYTES, "disk_path": str(tmp_path)}
    extra["disk_io_mode"] = "page_cache"
    harness = kvtier_harness(extra=extra, num_ranks=num_ranks, **overrides)
    invalid = record_invalid_blocks(harness)
    prompts = shared_prefix_prompts(2, prefix_len=PREFIX, suffix_len=8, num_prefixes=2)
    harness.run_requests(prompts, max_tokens=3)
    assert harness.scheduler.reset_prefix_cache()  # vLLM's GPU copies only
    for cache in harness.caches:
        cache.raw.zero_()
    corrupt = None
    if fault is not None:
        corrupt = CorruptSlot(offload_worker(harness, rank=num_ranks - 1), *fault)
    for request_id, prompt in prompts.items():
        harness.add_request(f"again-{request_id}", [*prompt, 9], max_tokens=3)
    computed: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    for _ in range(2000):
        if not harness.is_busy():
            break
        record = harness.drain_step()
        for new in record.scheduler_output.scheduled_new_reqs:
            computed.setdefault(new.req_id, new.num_computed_tokens)
        for engine_outputs in record.outputs.values():
            for out in engine_outputs.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not harness.is_busy()
    if corrupt is None or "kv_groups" in overrides:
        assert not invalid  # no fault, or a hybrid layout: no block-level report
    else:
        assert invalid == {corrupt.gpu_block}
    return harness, computed, outputs, corrupt


def record_invalid_blocks(harness: VllmHarness) -> set[int]:
    """Return a set every rank's load errors (`get_block_ids_with_load_errors`) go to."""
    invalid: set[int] = set()
    for worker in harness.workers:
        connector = worker.connector  # type: ignore[attr-defined]
        take = connector.get_block_ids_with_load_errors

        def take_and_record(take: Any = take) -> set[int]:
            blocks: set[int] = take()
            invalid.update(blocks)
            return blocks

        connector.get_block_ids_with_load_errors = take_and_record
    return invalid


@pytest.mark.parametrize("block", [0, 1, 3])
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_corrupted_slot_keeps_the_prefix_before_it(
    tmp_path: Path, num_ranks: int, which: int, block: int
) -> None:
    clean, clean_computed, clean_outputs, _ = serve(tmp_path / "clean", num_ranks, None)
    clean.close()
    assert set(clean_computed.values()) == {PREFIX}  # both loaded whole
    harness, computed, outputs, corrupt = serve(tmp_path / "bad", num_ranks, (which, block))
    assert corrupt is not None
    assert corrupt.gpu_block is not None, "the two prefixes never loaded in one event"
    bad, good = corrupt.request_ids[which], corrupt.request_ids[1 - which]
    # vLLM kept the blocks before the bad one (none recomputed), and only those.
    assert computed == {bad: 16 * block, good: PREFIX}
    assert outputs == clean_outputs
    assert all(len(tokens) == 3 for tokens in outputs.values())
    check_quiescent(harness)
    harness.close()


@pytest.mark.parametrize("scheduling", ["async", "async_pipelined"])
def test_the_prefix_is_kept_under_asynchronous_scheduling(tmp_path: Path, scheduling: str) -> None:
    """vLLM's `AsyncScheduler`, in lock-step and with step N+1 scheduled before step N's
    output (and its load errors) reach the scheduler."""
    overrides = SCHEDULING[scheduling]
    clean, _, clean_outputs, _ = serve(tmp_path / "clean", 1, None, **overrides)
    clean.close()
    harness, computed, outputs, corrupt = serve(tmp_path / "bad", 1, (1, 2), **overrides)
    assert corrupt is not None
    assert corrupt.gpu_block is not None, "the two prefixes never loaded in one event"
    bad, good = corrupt.request_ids[1], corrupt.request_ids[0]
    assert computed == {bad: 32, good: PREFIX}
    assert outputs == clean_outputs
    check_quiescent(harness)
    harness.close()


def test_a_hybrid_model_recomputes_a_failed_load_whole(tmp_path: Path) -> None:
    """Two KV cache groups (full attention and a 32-token window): vLLM refuses load
    errors by block (`_handle_invalid_blocks` raises), so the request that read the bad
    slot is reported in `failed_recving` and recomputes everything."""
    hybrid = {"kv_groups": (KVGroupDef(16), KVGroupDef(16, 32)), "num_gpu_blocks": 64}
    clean, _, clean_outputs, _ = serve(tmp_path / "clean", 1, None, **hybrid)
    clean.close()
    harness, computed, outputs, corrupt = serve(tmp_path / "bad", 1, (0, 1), **hybrid)
    assert corrupt is not None
    assert corrupt.gpu_block is not None, "the two prefixes never loaded in one event"
    bad, good = corrupt.request_ids
    assert computed == {bad: 0, good: PREFIX}
    assert outputs == clean_outputs
    check_quiescent(harness)
    harness.close()
