"""One prompt under other cache salts and LoRA adapters, stored and served by the tiers.

vLLM hashes a request's adapter and cache salt into its block hashes, so equal tokens
under another salt or adapter are another prefix. The harness's fake forward writes KV
that depends on them too (`fake_kv_cache.request_seed`): KV that a tier stored for one
salt or adapter and served to a request of another fails the forward's check
(`KVMismatchError`), after a demotion to disk as well.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from fake_kv_cache import chain_fingerprints
from gpu_eviction import evict_from_gpu
from kvtier_vllm import SCHEDULING, SLOT_BYTES, check_quiescent, kvtier_harness, scheduler_side
from vllm.lora.request import LoRARequest
from vllm_engine import PrefixFingerprints

A = LoRARequest("adapter-a", 1, "/adapters/a")
B = LoRARequest("adapter-b", 2, "/adapters/b")
# variant -> (cache salt, adapter)
VARIANTS: dict[str, tuple[str | None, LoRARequest | None]] = {
    "plain": (None, None),
    "salt-1": ("s1", None),
    "salt-2": ("s2", None),
    "a": (None, A),
    "b": (None, B),
    "a-salt-1": ("s1", A),
}
PROMPT = list(range(1000, 1053))  # 3 whole blocks of 16, then 5 tokens


def tier_extra(tier: str, disk_dir: Path) -> dict[str, Any]:
    """kvtier's config for `tier`: a CPU tier; a disk only; or a 7-block CPU tier over a
    disk (write-through cascade): the CPU tier evicts the prefixes, the disk serves them."""
    disk = {"disk_bytes": 256 * SLOT_BYTES, "disk_path": str(disk_dir)}
    disk["disk_io_mode"] = "page_cache"
    return {
        "cpu": {},
        "disk_only": {**disk, "cpu_bytes": 0},
        "cascade": {**disk, "cpu_bytes": 7 * SLOT_BYTES, "cascade": "write_through"},
    }[tier]


def test_the_fingerprints_of_equal_tokens_differ_by_salt_and_adapter() -> None:
    """Equal tokens under each variant have other fingerprints; a plain request's are the
    chain from 0 (those of the harness before salts and adapters counted)."""
    prints = {
        name: PrefixFingerprints().upto(
            SimpleNamespace(  # type: ignore[arg-type]
                request_id=name, all_token_ids=PROMPT, cache_salt=salt, lora_request=lora
            ),
            len(PROMPT),
        )
        for name, (salt, lora) in VARIANTS.items()
    }
    assert prints["plain"] == chain_fingerprints(0, PROMPT)
    firsts = {values[0] for values in prints.values()}
    assert len(firsts) == len(VARIANTS), "the first position already differs"
    assert len({tuple(values) for values in prints.values()}) == len(VARIANTS)


@pytest.mark.parametrize("scheduling", ["sync", "async_pipelined"])
@pytest.mark.parametrize("tier", ["cpu", "disk_only", "cascade"])
def test_each_salt_and_adapter_gets_its_own_prefix_from_the_tiers(
    tier: str, scheduling: str, tmp_path: Path
) -> None:
    """The prompt under six variants (none, two salts, two adapters, an adapter with a
    salt), sent together, is stored once per variant (the cascade's 7-block CPU tier
    takes one request's stores at a time: sent one after the other there); evicted from
    the GPU (and the cascade's CPU tier) and sent again together, every request
    loads its 3 prefix blocks from the tier, and the forward's checks find its own
    variant's KV there."""
    harness = kvtier_harness(
        max_loras=2,
        num_gpu_blocks=16,
        extra=tier_extra(tier, tmp_path),
        **SCHEDULING[scheduling],
    )
    try:
        for name, (salt, lora) in VARIANTS.items():
            harness.add_request(name, PROMPT, 2, cache_salt=salt, lora_request=lora)
            if tier == "cascade":
                harness.run()
        harness.run()
        fillers = evict_from_gpu(harness, VARIANTS)
        again = {f"again-{name}": variant for name, variant in VARIANTS.items()}
        for request_id, (salt, lora) in again.items():
            harness.add_request(request_id, PROMPT, 2, cache_salt=salt, lora_request=lora)
        harness.run()
        assert harness.finished == set(VARIANTS) | set(fillers) | set(again)
        assert [harness.local_hit_tokens(r) for r in again] == [0] * len(again)
        assert [harness.external_hit_tokens(r) for r in again] == [48] * len(again)
        assert scheduler_side(harness).offload.take_stats().num_tag_mismatches == 0
        check_quiescent(harness)
    finally:
        harness.close()
