"""vLLM 0.33 copies a partial hit's tail from a block the same step's forward has yet to write.

Found by the s22 vLLM fuzzer (seed 3181): a hybrid model with a coarse Mamba group
(32-token blocks), `prefix_match_unit` 16 and EAGLE. vLLM caches the full blocks of a
step's new tokens when it schedules them (`KVCacheManager.allocate_slots` ->
`cache_blocks(total_computed_tokens + num_new_tokens)`), so a request admitted later in
the same `schedule()` call can hit a block that this step's forward will only then
write. A whole-block hit is safe there (the forward writes a layer's KV before it reads
it); but EAGLE drops one hash unit of a fine-grained hit
(`FullAttentionManager.find_longest_cache_hit`: `hit_length -= min(alignment_tokens,
block_size)`), which turns that whole-block hit into a partial one, and a partial hit
is served by copy-on-write (`allocate_new_blocks` -> `_apply_cow`, queued in
`SchedulerOutput.kv_cache_block_copies`). The model runner runs those copies before the
forward (`gpu_model_runner.py` `_update_states`, `worker/gpu/model_runner.py`: "before
the forward pass reads them"), so the copy carries whatever the source block held
before: the request reads another prefix's KV (or zeros) at its first positions.
The Mamba group's guard against same-step hits (`MambaManager.get_num_blocks_to_allocate`:
`cached_blocks_this_step`) does not cover it: the Mamba state hit comes from an earlier
step, only the attention block is this step's.

Here with a connector that offers nothing and stores nothing (`RecordingConnector`):
the defect is vLLM's, kvtier or not. (With no connector configured at all, vLLM 0.33
schedules these requests otherwise and this schedule does not arise.) kvtier offers no
tokens to such a request; what vLLM then serves is its own local hit.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm_engine import HarnessConfig, KVGroupDef, KVMismatchError
from vllm_harness import VllmHarness

UNIT = 16  # prefix_match_unit: the hash block size


def tokens(seed: int, count: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(1000, 30000) for _ in range(count)]


def harness(eagle: bool) -> VllmHarness:
    return VllmHarness(
        HarnessConfig(
            connector="RecordingConnector",
            connector_module="recording_connector",
            kv_groups=(KVGroupDef(32), KVGroupDef(32, mamba=True)),
            block_size=32,
            prefix_match_unit=UNIT,
            num_gpu_blocks=28,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            eagle=eagle,
        )
    )


def add_requests(h: VllmHarness) -> None:
    """Three 32-token prompts fill the first two steps (16 tokens each a step: the Mamba
    state of "p1" at the shared 16-token prefix is cached in the first); the long prompt
    waits, then prefills its first block in the step that admits "short" (its first 32
    tokens: a whole-block hit on that block, 16 tokens after EAGLE's drop)."""
    prefix, second = tokens(1, UNIT), tokens(2, UNIT)
    h.add_request("p1", prefix + tokens(3, UNIT), 1)
    h.add_request("p2", prefix + tokens(4, UNIT), 1)
    h.add_request("other", tokens(5, 2 * UNIT), 1)
    h.add_request("long", prefix + second + tokens(6, 53), 1)
    h.add_request("short", prefix + second, 1)


def test_vllm_copies_a_partial_hit_from_a_block_its_forward_has_not_written() -> None:
    # vLLM's defect: should a later vLLM defer such a hit (or copy after the writes),
    # this fails; update docs/vllm.md (Fault tolerance: known vLLM defects).
    h = harness(eagle=True)
    try:
        add_requests(h)
        for _ in range(2):
            assert "long" not in h.step().num_scheduled_tokens
        output = h.scheduler.schedule()  # the third step, scheduled by hand: no forward
        new = {req.req_id: req for req in output.scheduled_new_reqs}
        assert output.num_scheduled_tokens == {"long": 32, "short": 16}
        assert new["long"].num_computed_tokens == 0
        assert new["short"].num_computed_tokens == 16  # its first 32, less EAGLE's unit
        long_block = new["long"].block_ids[0][0]  # attention group, tokens 0-31
        short_block = new["short"].block_ids[0][0]
        copies = {(c.src_block_id, c.dst_block_id) for c in output.kv_cache_block_copies or ()}
        assert (long_block, short_block) in copies  # CoW from a block "long" writes now
    finally:
        h.close()


def test_vllm_serves_that_copy_as_kv() -> None:
    h = harness(eagle=True)
    try:
        add_requests(h)
        with pytest.raises(KVMismatchError, match="request short: position 0 "):
            h.run()
    finally:
        h.close()


def test_without_eagle_the_same_requests_read_their_own_kv() -> None:
    # The control: no hit is trimmed, "short" hits 16 tokens of a block written earlier.
    h = harness(eagle=False)
    try:
        add_requests(h)
        h.run()  # the harness checks every position each forward reads
        assert h.admissions["short"] == (16, 0)  # (local, external) tokens
    finally:
        h.close()
