"""End-to-end: the token check on hit (SPEC §3 Beyond) on the reference engine.

A deliberately weak block hash (token ids taken mod 100) makes two prompts collide in
every block. Without the check the second prompt is served the first one's KV from the
CPU tier and its logits go wrong; with the check it is recomputed and matches a run
without offload exactly.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import pytest
import torch

from kvtier.core.hashing import BlockHasher
from kvtier.core.keys import BlockHash
from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def weak_hash_block(
    self: BlockHasher,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] = (),
) -> BlockHash:
    """A block hash that sees token ids mod 100: ids 3 and 103 collide."""
    message = (parent or self.root_hash) + bytes(t % 100 for t in token_ids)
    return hashlib.sha256(message).digest()


def prompts() -> tuple[list[int], list[list[int]], list[int]]:
    """Return prompt A (ids < 28), fillers (28..99) and B = A + 100: B collides with A."""
    rng = random.Random(7)
    first = [rng.randrange(28) for _ in range(32)]
    fillers = [[rng.randrange(28, 100) for _ in range(40)] for _ in range(3)]
    return first, fillers, [t + 100 for t in first]


def serve(offload: OffloadConfig | None) -> tuple[RequestOutput, int]:
    """Serve A, then fillers that push A out of the GPU cache, then B; return B's output
    and the tag mismatches the offload scheduler counted."""
    first, fillers, second = prompts()
    engine = EngineConfig(block_size=4, num_gpu_blocks=24, keep_logits=True)
    with LLM(ModelConfig.tiny(), kv_offload=offload, engine=engine) as llm:
        llm.generate([first], PARAMS)
        for filler in fillers:
            llm.generate([filler], PARAMS)
        llm.drain()
        (output,) = llm.generate([second], PARAMS)
        totals = llm.offload.totals.num_tag_mismatches if llm.offload is not None else 0
    return output, totals


def test_a_hash_collision_serves_wrong_kv_without_the_check_and_none_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BlockHasher, "hash_block", weak_hash_block)
    reference, _ = serve(None)
    assert reference.num_local_hit_tokens == 0  # the fillers evicted A from the GPU cache
    assert reference.logits is not None

    unchecked, _ = serve(OffloadConfig(cpu_bytes=1 << 20))
    assert unchecked.num_external_hit_tokens > 0, "the collision should hit the tier"
    assert unchecked.logits is not None
    assert not torch.allclose(reference.logits, unchecked.logits, atol=1e-3), (
        "A's KV served to B should change B's logits"
    )

    checked, mismatches = serve(OffloadConfig(cpu_bytes=1 << 20, token_check=True))
    assert checked.num_external_hit_tokens == 0
    assert mismatches > 0
    assert checked.output_token_ids == reference.output_token_ids
    assert checked.logits is not None
    assert torch.allclose(reference.logits, checked.logits, atol=1e-5, rtol=0)


def test_the_check_passes_honest_hits() -> None:
    """With real hashes, the check changes no hit: B repeats A and is served from the tier."""
    first, fillers, _ = prompts()
    engine = EngineConfig(block_size=4, num_gpu_blocks=24)
    with LLM(
        ModelConfig.tiny(),
        kv_offload=OffloadConfig(cpu_bytes=1 << 20, token_check=True),
        engine=engine,
    ) as llm:
        (a,) = llm.generate([first], PARAMS)
        for filler in fillers:
            llm.generate([filler], PARAMS)
        llm.drain()
        (again,) = llm.generate([first], PARAMS)
        assert llm.offload is not None
        assert llm.offload.totals.num_tag_mismatches == 0
    assert again.num_external_hit_tokens >= 28
    assert again.output_token_ids == a.output_token_ids
