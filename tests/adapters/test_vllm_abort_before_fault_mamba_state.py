"""A request aborted while a step of it is in flight, before that step's forward fails,
on a Mamba hybrid whose 32-token blocks span two 16-token hash blocks.

vLLM's Mamba "align" mode copies the state at a hash-block boundary out of the request's
table (`KVCacheBlockCopy`), keyed by the request's partial key there; the table keeps the
running state. kvtier took an unconfirmed finish's blocks from its table only, so it
dropped the attention block's keys but left that state block cached: the next step gave
`r2` a 16-token local hit (the state's length) on the attention block `r1` was given and
keyed in the same step, and vLLM copied that block for `r2` (partial-hit copy-on-write)
before `r1`'s forward wrote it. vLLM alone keeps both groups' keys and serves them, and
fails the same way once only the attention block's keys are gone (the canary below).
Found by a fuzzing helper (seed 101310 of its pipelined-fault op, cut to 3 operations).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from forward_faults import drain_deferred_frees, raise_from_forward
from kvtier_vllm import kvtier_harness
from random_ops import FAMILIES
from test_vllm_fault_tolerance import apply_output, fault_abort
from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.request import RequestStatus
from vllm_engine import HarnessConfig, KVGroupDef, KVMismatchError
from vllm_harness import VllmHarness

CONFIG = {
    "num_gpu_blocks": 16,
    "block_size": 32,
    "kv_groups": (KVGroupDef(32), KVGroupDef(32, mamba=True)),
    "prefix_match_unit": 16,
    "max_num_batched_tokens": 64,
    "long_prefill_token_threshold": 40,
}
PREFIX = FAMILIES[2][:64]


def tail(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(length)]


def add_two_sharing_the_prefix(harness: VllmHarness, first: int = 1) -> None:
    """Add two requests of 64 tokens of `PREFIX` (the first is scheduled first), run them."""
    harness.add_request(f"r{first}", [*PREFIX, *tail(0, 16)], max_tokens=4)
    harness.add_request(f"r{first + 1}", [*PREFIX, *tail(1, 16)], max_tokens=4)
    harness.run(200)


def abort_before_the_fault(harness: VllmHarness, prompts: list[list[int]], abort: str) -> None:
    """Add `prompts` (r0, r1, ...); launch two steps, schedule step F, process the first
    step's output, abort `abort`, schedule two more (nothing left to schedule but the
    rest), process the second step's output, fail F's forward (Model Runner V1), abort
    what is left as vLLM's fault handler does and feed the later steps' outputs."""
    for index, prompt in enumerate(prompts):
        harness.add_request(f"r{index}", prompt, max_tokens=1 if len(prompts) > 1 else 8)
    launched = [harness._launch(), harness._launch()]
    step_f = harness.scheduler.schedule()
    for cache in harness.caches:
        cache.copy_blocks(step_f.kv_cache_block_copies or ())
    for worker in harness.workers:
        worker.before_forward(step_f)
    harness._complete(*launched[0])
    harness.scheduler.finish_requests(abort, RequestStatus.FINISHED_ABORTED)
    later = [harness.scheduler.schedule(), harness.scheduler.schedule()]
    harness._complete(*launched[1])
    for worker in harness.workers:
        raise_from_forward(worker, step_f, v2=False)
    outputs = []
    for step in later:
        for worker in harness.workers:
            worker.before_forward(step)
        outputs += [worker.after_forward(step) for worker in harness.workers]
    fault_abort(harness)
    drain_deferred_frees(harness)
    for output in outputs:
        apply_output(harness, output)


@pytest.mark.parametrize("held", [False, True], ids=["free", "held_by_a_hit"])
def test_the_boundary_state_of_a_request_aborted_before_the_fault_loses_its_key(
    held: bool,
) -> None:
    # Was: KVMismatchError 'request r2: position 0 (group 0, block 5, layer 0) holds KV
    # of another prefix' (a 16-token local hit copied from r1's unwritten block);
    # held_by_a_hit (r1 hit r0's state in step F): 'request r3: position 0 (group 0,
    # block 2, layer 0)', its key kept as another request held the block.
    harness = kvtier_harness(
        extra={"store_mode": "eager"}, async_scheduling=True, batch_queue_size=3, **CONFIG
    )
    try:
        if held:
            prompts = [[*FAMILIES[3][:16], *tail(seed, 16)] for seed in (1, 2)]
            abort_before_the_fault(harness, prompts, "r0")
            harness.add_request("r2", [*FAMILIES[3][:64], *tail(0, 21)], max_tokens=4)
            harness.add_request("r3", [*FAMILIES[3][:64], *tail(1, 21)], max_tokens=4)
            harness.run(200)
        else:
            abort_before_the_fault(harness, [[*PREFIX[:16], *tail(0, 5)]], "r0")
            add_two_sharing_the_prefix(harness)
    finally:
        harness.close()


def test_vllm_copies_a_block_it_keyed_in_the_same_step_for_a_partial_hit() -> None:
    # vLLM's defect without kvtier (no connector): the attention group's keys of r0's
    # prefix evicted (`BlockPool.evict_blocks`), its Mamba state at 16 still cached. Should
    # a later vLLM copy only written blocks, this fails: kvtier could then keep the state.
    harness = VllmHarness(HarnessConfig(**CONFIG))
    try:
        harness.add_request("r0", [*PREFIX[:16], *tail(0, 5)], max_tokens=2)
        harness.run(50)
        pool = harness.scheduler.kv_cache_manager.block_pool
        cache = pool.cached_block_hash_to_block._cache
        attention = {
            block_id
            for key, blocks in cache.items()
            if get_group_id(key) == 0
            for block_id in (blocks if isinstance(blocks, dict) else [blocks.block_id])
        }
        pool.evict_blocks(attention)
        with pytest.raises(KVMismatchError, match="request r2: position 0"):
            add_two_sharing_the_prefix(harness)
    finally:
        harness.close()
