"""LoRA requests through vLLM's scheduler with LoRA on (`HarnessConfig.max_loras`).

vLLM hashes a request's adapter (name and path) into every block hash, and its GPU
events name the adapter (`lora_id`, `lora_name`, the name among the extra keys). The
tier's events for the same hashes must say the same (SPEC §6.10), and a prefix stored
under one adapter must never be served to a request of another adapter or of none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from gpu_eviction import evict_from_gpu
from kvtier_vllm import (
    SCHEDULING,
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    scheduler_side,
)
from vllm.distributed.kv_events import BlockStored
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm_harness import VllmHarness, flatten_events, shared_prefix_prompts

A = LoRARequest("adapter-a", 1, "/adapters/a")
B = LoRARequest("adapter-b", 2, "/adapters/b")
PROMPT = list(range(1000, 1053))  # 3 whole blocks of 16, then 5 tokens


def stored_blocks(harness: VllmHarness, medium: str) -> dict[Any, tuple[Any, ...]]:
    """Each hash stored on `medium`: (LoRA id, LoRA name, extra keys, tokens, parent),
    one block of a batched vLLM event at a time."""
    out = {}
    for e in flatten_events(harness.event_batches):
        if not (isinstance(e, BlockStored) and e.medium == medium):
            continue
        extra_keys = e.extra_keys or [None] * len(e.block_hashes)
        for i, (block_hash, keys) in enumerate(zip(e.block_hashes, extra_keys, strict=True)):
            tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
            parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            out[block_hash] = (e.lora_id, e.lora_name, keys, tokens, parent)
    return out


def run_one(harness: VllmHarness, request_id: str, lora: LoRARequest | None) -> None:
    harness.add_request(request_id, PROMPT, max_tokens=3, lora_request=lora)
    harness.run()


def test_tier_events_of_lora_blocks_carry_vllm_s_lora_fields() -> None:
    """The CPU events of every block stored for requests of adapter A, of adapter B with
    a cache salt and of no adapter equal vLLM's GPU events for the same hashes."""
    harness = kvtier_harness(max_loras=2, enable_kv_events=True)
    try:
        harness.add_request("a", PROMPT, max_tokens=2, lora_request=A)
        harness.add_request("b", PROMPT, max_tokens=2, lora_request=B, cache_salt="tenant")
        harness.add_request("plain", PROMPT, max_tokens=2)
        harness.run()
        assert harness.finished == {"a", "b", "plain"}
        gpu, cpu = stored_blocks(harness, "GPU"), stored_blocks(harness, "CPU")
        hashes = {
            r: [maybe_convert_block_hash(h) for h in harness.requests[r].block_hashes]
            for r in ("a", "b", "plain")
        }
        assert all(len(h) == 3 for h in hashes.values())
        assert set(cpu) == {h for request_hashes in hashes.values() for h in request_hashes}
        assert cpu == {h: gpu[h] for h in cpu}
        assert [cpu[h][:3] for h in hashes["a"]] == [(1, "adapter-a", ("adapter-a",))] * 3
        assert [cpu[h][:3] for h in hashes["b"]] == [
            (2, "adapter-b", ("adapter-b", "tenant")),  # the salt is hashed into block 0 only
            (2, "adapter-b", ("adapter-b",)),
            (2, "adapter-b", ("adapter-b",)),
        ]
        assert [cpu[h][:3] for h in hashes["plain"]] == [(None, None, None)] * 3
        assert all(cpu[h][3] for h in cpu), "eager stores carry their tokens"
        check_quiescent(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("token_check", [False, True], ids=["", "token_check"])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_prefix_stored_under_one_adapter_serves_that_adapter_only(
    scheduling: str, token_check: bool
) -> None:
    """Stored under adapter A and evicted from the GPU, the prompt's prefix is served from
    the tier to adapter A only: adapter B and the base model recompute it. With
    `token_check` the hit's tokens and extra keys (the adapter's) match the stored ones."""
    harness = kvtier_harness(
        max_loras=1,
        num_gpu_blocks=16,
        extra={"token_check": token_check},
        **SCHEDULING[scheduling],
    )
    try:
        run_one(harness, "first", A)
        evict_from_gpu(harness, ["first"])
        for request_id, lora in (("other-adapter", B), ("base-model", None)):
            run_one(harness, request_id, lora)
            assert harness.local_hit_tokens(request_id) == 0
            assert harness.external_hit_tokens(request_id) == 0, f"{request_id} got A's KV"
        run_one(harness, "again", A)
        assert harness.local_hit_tokens("again") == 0, "the GPU copy should be evicted"
        assert harness.external_hit_tokens("again") == 48
        assert harness.finished >= {"first", "other-adapter", "base-model", "again"}
        assert scheduler_side(harness).offload.take_stats().num_tag_mismatches == 0
        check_quiescent(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_two_adapters_under_max_loras_one_load_their_own_prefixes(scheduling: str) -> None:
    """Requests of two adapters over two prefixes, stored, evicted from the GPU and sent
    again all at once: every request loads its own adapter's prefix (vLLM's `max_loras`
    counts running requests only, so the loads of both adapters are admitted), then
    vLLM runs one adapter at a time (`max_loras=1`), A's loaded requests waiting while
    B's run; every request finishes and nothing is left pinned or tracked."""
    harness = kvtier_harness(max_loras=1, num_gpu_blocks=24, **SCHEDULING[scheduling])
    prompts = shared_prefix_prompts(2, prefix_len=48, suffix_len=5, num_prefixes=2, seed=3)
    runs = {f"{r}-{lora.lora_name}": (p, lora) for r, p in prompts.items() for lora in (B, A)}
    try:
        for request_id, (prompt, lora) in runs.items():
            harness.add_request(request_id, prompt, max_tokens=3, lora_request=lora)
        harness.run()
        fillers = evict_from_gpu(harness, runs)
        for request_id, (prompt, lora) in runs.items():
            harness.add_request(f"again-{request_id}", [*prompt, 7], 3, lora_request=lora)
        adapters: list[set[str | None]] = []  # each run of steps' adapters, in order
        for record in busy_steps(harness):
            scheduled = record.num_scheduled_tokens
            loras = [harness.requests[r].lora_request for r in scheduled]
            names = {lora.lora_name if lora else None for lora in loras}
            if names and names != (adapters or [None])[-1]:
                adapters.append(names)
        assert adapters == [{"adapter-b"}, {"adapter-a"}]
        again = [f"again-{r}" for r in runs]
        assert harness.finished == set(runs) | set(fillers) | set(again)
        assert [harness.local_hit_tokens(r) for r in again] == [0] * 4
        assert [harness.external_hit_tokens(r) for r in again] == [48] * 4
        check_quiescent(harness)
    finally:
        harness.close()


@pytest.mark.parametrize("cascade", [False, True], ids=["cpu", "cascade"])
def test_lazy_stores_of_lora_blocks_name_the_adapter(tmp_path: Path, cascade: bool) -> None:
    """Lazy stores carry no token payload (SPEC §6.10), but the CPU events of blocks
    stored for adapters A and B still name the adapter and carry the extra keys (the
    adapter's name, B's cache salt in block 0) as vLLM's GPU events of the same hashes
    do, and so do the disk events of their demotions (a write-through cascade); blocks
    of no adapter name none, and say `[None]` (none) as vLLM does, not None (unknown)."""
    extra: dict[str, Any] = {"store_mode": "lazy"}
    if cascade:
        extra |= {
            "disk_bytes": 256 * SLOT_BYTES,
            "disk_path": str(tmp_path),
            "disk_io_mode": "page_cache",
            "cascade": "write_through",
        }
    harness = kvtier_harness(max_loras=2, enable_kv_events=True, extra=extra)
    try:
        harness.add_request("a", PROMPT, max_tokens=2, lora_request=A)
        harness.add_request("b", PROMPT, max_tokens=2, lora_request=B, cache_salt="tenant")
        harness.add_request("plain", PROMPT, max_tokens=2)
        harness.run()
        for _ in range(8):  # the walk copies the finished requests' freed blocks
            harness.step()
        assert harness.finished == {"a", "b", "plain"}
        gpu = stored_blocks(harness, "GPU")
        hashes = {
            r: [maybe_convert_block_hash(h) for h in harness.requests[r].block_hashes]
            for r in ("a", "b", "plain")
        }
        for medium in ("CPU", "STORAGE") if cascade else ("CPU",):
            tier = stored_blocks(harness, medium)
            assert set(tier) == {h for request_hashes in hashes.values() for h in request_hashes}
            assert {h: tier[h][:3] for h in tier} == {h: gpu[h][:3] for h in tier}
            assert tier[hashes["b"][0]][2] == ("adapter-b", "tenant")
            raw = [e for e in flatten_events(harness.event_batches) if e.medium == medium]
            assert all(e.extra_keys is not None for e in raw if isinstance(e, BlockStored))
            assert [tier[h][:2] for h in hashes["a"]] == [(1, "adapter-a")] * 3
            assert [tier[h][:2] for h in hashes["b"]] == [(2, "adapter-b")] * 3
            assert [tier[h][:2] for h in hashes["plain"]] == [(None, None)] * 3
            assert not any(tier[h][3] for h in tier), "lazy stores carry no tokens"
        check_quiescent(harness)
    finally:
        harness.close()
