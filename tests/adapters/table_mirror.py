"""Compare kvtier's copy of each request's block table with vLLM's, every step.

Test helper only: import it after `pytest.importorskip("vllm")`. `TableMirror` wraps the
scheduler role's `build_metadata`: once kvtier applied a step's block ids, every request
kvtier tracks must hold vLLM's table (`KVCacheManager.get_block_ids`, its
`req_to_blocks`), per group: equal in a full-attention group; in a sliding window, equal
where vLLM's is not the null block (vLLM nulls the blocks a window drops in place, and
its model runner, like kvtier, keeps what it was sent: append-only); in a Mamba state
group, of the same length (vLLM moves a running request's scratch state blocks in place:
kvtier never reads those by position). A request vLLM does not run has an empty table.
`audit_tier` copies every tier block back and checks its KV (or state) against its key.
"""

from __future__ import annotations

import collections
from typing import Any

from kvtier_vllm import offload_worker, scheduler_side
from vllm.v1.request import RequestStatus
from vllm_engine import PrefixFingerprints
from vllm_harness import VllmHarness

from kvtier.core.block_pool import NULL_BLOCK_ID
from kvtier.core.keys import key_block_hash, key_group_id
from kvtier.offload.plan import Tier, TransferJob, TransferPlan

AUDIT_EVENT_ID = 10**9  # event ids of the audit's copies, far above kvtier's


class TableMirror:
    """Check kvtier's tables against vLLM's after each `build_metadata`; count what ran."""

    def __init__(self, harness: VllmHarness) -> None:
        self.harness = harness
        self.side = scheduler_side(harness)
        self.counts: collections.Counter[str] = collections.Counter()
        build = self.side.build_metadata

        def checked(scheduler_output: Any) -> Any:
            metadata = build(scheduler_output)
            self.check(scheduler_output)
            return metadata

        self.side.build_metadata = checked  # type: ignore[method-assign]

    def check(self, scheduler_output: Any) -> None:
        """Compare every tracked request's tables; count resumed and preempted ones."""
        scheduler = self.harness.scheduler
        cached = scheduler_output.scheduled_cached_reqs
        self.counts["resumed_as_cached"] += len(cached.resumed_req_ids)
        self.counts["preempted"] += len(scheduler_output.preempted_req_ids or ())
        loading = [
            r
            for r in scheduler.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        if scheduler_output.preempted_req_ids and loading:
            self.counts["preempted_while_loading"] += 1
        self.counts["resumed_loading"] += sum(1 for r in loading if r.num_preemptions)
        for data in scheduler_output.scheduled_new_reqs:
            if scheduler.requests[data.req_id].num_preemptions:
                self.counts["resumed_as_new"] += 1
        for req_id, state in self.side.offload.selector.tracked.items():
            request = scheduler.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                assert not any(state.block_ids), f"{req_id} ({request and request.status}) kept"
                continue
            theirs = scheduler.kv_cache_manager.get_block_ids(req_id)
            for group_id, (group, mine, vllm) in enumerate(
                zip(self.harness.cfg.groups, state.block_ids, theirs, strict=True)
            ):
                where = f"{req_id} group {group_id}: kvtier {mine}, vLLM {list(vllm)}"
                assert len(mine) == len(vllm), where
                if group.mamba:
                    continue
                for ours, real in zip(mine, vllm, strict=True):
                    if ours != real:  # only a block vLLM's window dropped (nulled in place)
                        assert group.sliding_window, where
                        assert real == NULL_BLOCK_ID, where
                        self.counts["window_dropped"] += 1
            self.counts["tables_compared"] += 1


def audit_tier(harness: VllmHarness) -> int:
    """Copy every block the tiers index to scratch GPU blocks of every rank and check it
    holds the KV of the prefix its key hashes; return how many.

    The key names the hash block that ends it: in a group of a larger block size a whole
    block ends at its last hash block, a partial one earlier; a state group's block holds
    the state of that end's last token. Call when vLLM is idle and its GPU prefix cache
    reset: every GPU block is scratch.
    """
    blocks: dict[Any, tuple[Any, int]] = {}  # vLLM block hash -> (request, block index)
    for request in harness.requests.values():
        for index, block_hash in enumerate(request.block_hashes):
            blocks.setdefault(block_hash, (request, index))
    fingerprints = PrefixFingerprints()
    scratch = range(1, harness.cfg.num_gpu_blocks)
    num_audited = 0
    for tier, pool in scheduler_side(harness).offload.index.pools.items():
        keys = {slot: pool.key(slot) for slot in range(1, pool.num_blocks)}
        slots = [slot for slot, key in keys.items() if key is not None]
        for start in range(0, len(slots), len(scratch)):
            batch = tuple(slots[start : start + len(scratch)])
            event_id = AUDIT_EVENT_ID + num_audited
            job = TransferJob(event_id, tier, Tier.GPU, batch, tuple(scratch[: len(batch)]))
            for rank in range(harness.cfg.num_ranks):
                worker = offload_worker(harness, rank)
                worker.submit(TransferPlan(step_id=0, jobs=(job,)))
                worker.flush()
                report = worker.poll()
                assert (report.done, report.failed) == ({event_id: 1}, {}), report
            for slot, gpu_block in zip(batch, scratch, strict=False):
                key = keys[slot]
                assert key is not None
                group = key_group_id(key)
                request, index = blocks[key_block_hash(key)]
                end = (index + 1) * harness.cfg.hash_block_size
                prints = fingerprints.upto(request, end)
                for cache in harness.caches:
                    size = cache.block_sizes[group]
                    first = end - 1 if cache.is_state[group] else (end - 1) // size * size
                    table = [0] * (first // size) + [gpu_block]
                    what = f"{tier.value} slot {slot}"
                    cache.check_positions(what, group, table, prints, range(first, end))
                num_audited += 1
    return num_audited
