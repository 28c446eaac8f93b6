"""The bytes one GPU block id spans in vLLM's KV allocation, padding included (test
helper; no vLLM import, so test_vllm_pure.py runs without vLLM).

kvtier sizes its tier slots by the pages a block id holds (`layout.bytes_per_slot`), not
by this span: vLLM may round a block-outermost block up to its layers'
`block_stride_alignment`. The tests use the span to show that a config they build is
padded (the span exceeds the slot), or is not.
"""

from __future__ import annotations

from typing import Any


def bytes_per_block_id(kv_cache_config: Any) -> int:
    """Return the bytes one block id spans in `kv_cache_config`'s device allocation."""
    sizes = [int(t.size) for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    assert sizes, "the config has no KV cache tensors on the device"
    return max(sizes) // int(kv_cache_config.num_blocks)
