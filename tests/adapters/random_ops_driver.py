"""The example driver `Run` of `test_vllm_random_ops` (its operations: `random_ops`).

Test helper only: import it after `pytest.importorskip("vllm")`. `Run` is one example: a
`kvtier_harness` engine with a `FaultyWorker` (faulty_worker.py) per rank (the test's
docstring says more); `run_example` applies an example's operations and checks the end.
"""

from __future__ import annotations

import collections
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

from faulty_worker import FaultyWorker
from forward_faults import ForwardFaults
from kvtier_vllm import (
    SLOT_BYTES,
    check_quiescent,
    kvtier_harness,
    kvtier_worker,
    num_resent,
    offload_worker,
    scheduler_side,
)
from multi_connector import multi_harness
from random_ops import (
    BLOCK,
    Abort,
    Add,
    Delay,
    Drain,
    Engine,
    Fail,
    FailPart,
    Fault,
    Reset,
    Step,
)
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request, RequestStatus
from vllm_engine import PrefixFingerprints
from vllm_harness import flatten_events

from kvtier.adapters.vllm.events import vllm_medium
from kvtier.core.keys import Key, key_block_hash, key_group_id
from kvtier.offload.plan import Tier, TransferJob

MAX_DRAIN_STEPS = 600
AUDIT_EVENT_ID = 10**9  # event ids of the tier audit's copies, far above kvtier's


class Run:
    """One example: a harness with a `FaultyWorker` per rank, and its bookkeeping."""

    def __init__(self, engine: Engine, totals: collections.Counter[str], disk_dir: str) -> None:
        extra: dict[str, Any] = {"store_mode": engine.store_mode, "policy": engine.policy}
        if engine.token_check:
            extra["token_check"] = True
        if engine.fine_grained_hits:
            extra["fine_grained_hits"] = True
        num_cpu_blocks = engine.num_cpu_blocks
        if engine.cascade is not None:
            num_cpu_blocks = 7
            extra.update(
                disk_bytes=41 * SLOT_BYTES,
                disk_path=disk_dir,
                disk_io_mode="page_cache",
                cascade=engine.cascade,
            )
        elif engine.disk_only:
            extra.update(
                cpu_bytes=0,
                disk_bytes=num_cpu_blocks * SLOT_BYTES,
                disk_path=disk_dir,
                disk_io_mode="page_cache",
            )
        build = kvtier_harness if engine.multi is None else partial(multi_harness, engine.multi)
        self.harness = build(
            num_cpu_blocks=num_cpu_blocks,
            num_gpu_blocks=engine.num_gpu_blocks,
            block_size=min((g.block_size for g in engine.kv_groups), default=BLOCK),
            kv_groups=engine.kv_groups,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            num_ranks=engine.num_ranks,
            async_scheduling=engine.async_batches > 0,
            batch_queue_size=max(1, engine.async_batches),
            enable_kv_events=engine.events,
            scheduling_policy=engine.scheduling_policy,
            eagle=engine.eagle,
            drafts=engine.drafts,
            prefix_match_unit=engine.prefix_match_unit,
            extra=extra,
        )
        self.side = scheduler_side(self.harness)
        self.workers = [
            FaultyWorker(offload_worker(self.harness, rank), self._zeroer(rank))
            for rank in range(engine.num_ranks)
        ]
        self.faults = ForwardFaults(self.harness)
        self.totals = totals
        self.prompts: dict[str, list[int]] = {}
        self.num_audits = 0

    def _zeroer(self, rank: int) -> Callable[[tuple[int, ...]], None]:
        def scribble(block_ids: tuple[int, ...]) -> None:
            for tensor in self.harness.caches[rank].tensors.values():
                tensor[list(block_ids)] = 0

        return scribble

    def close(self) -> None:
        for rank in range(len(self.workers)):
            kvtier_worker(self.harness, rank).connector.shutdown()
        self.harness.close()

    # ------------------------------------------------------------------ operations
    def apply(self, op: object) -> None:
        scheduler = self.harness.scheduler
        if isinstance(op, Add):
            for prompt in op.prompts():
                request_id = f"r{len(self.prompts)}"
                self.prompts[request_id] = prompt = prompt or [7]
                self.harness.add_request(request_id, prompt, op.max_tokens, priority=op.priority)
        elif isinstance(op, Step):
            for _ in range(op.num_steps):
                self.step()
        elif isinstance(op, Drain):
            self.drain_steps()
        elif isinstance(op, Abort):
            live = sorted(r for r, req in scheduler.requests.items() if not req.is_finished())
            if live:
                scheduler.finish_requests(live[op.pick % len(live)], RequestStatus.FINISHED_ABORTED)
                self.totals["aborts"] += 1
        elif isinstance(op, Reset):
            self.reset(op.what)
        elif isinstance(op, Delay):
            worker = self.workers[op.rank % len(self.workers)]
            worker.delay[op.kind] = op.start
            worker.hold[op.kind] = op.hold
        elif isinstance(op, Fail):
            self.workers[op.rank % len(self.workers)].fail[op.kind] += 1
        elif isinstance(op, FailPart):
            self.workers[op.rank % len(self.workers)].fail_part += 1
        elif isinstance(op, Fault):
            rank = None if op.rank is None else op.rank % len(self.workers)
            failed = self.faults.fail_step(rank, op.v2)
            self.totals["faults_v2" if op.v2 else "faults"] += failed
        self.check()

    def step(self) -> None:
        record = self.harness.step()
        self.totals["preemptions"] += len(record.scheduler_output.preempted_req_ids or ())
        self.check(workers=False)  # the workers' after every operation: they cost more

    def reset(self, what: str) -> None:
        scheduler = self.harness.scheduler
        if what == "gpu":
            done = scheduler.reset_prefix_cache()
        elif what == "gpu_running":
            # vLLM raises when a block is still referenced after it preempted every
            # running request: a request waiting for its load, or a store kvtier pins.
            try:
                done = scheduler.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError as error:
                if "Failed to reset KV cache" not in str(error):
                    raise
                done = False
        elif what == "connector":
            done = scheduler.reset_connector_cache()
        else:
            done = scheduler.reset_prefix_cache(reset_connector=True)
        self.totals[f"reset_{what}_{'done' if done else 'refused'}"] += 1

    def check(self, workers: bool = True) -> None:
        """Check kvtier's scheduler (and, unless told not to, its workers') invariants."""
        self.side.offload.check_invariants()
        requests = self.harness.scheduler.requests.values()
        live = sum(not request.is_finished() for request in requests)
        assert self.side.num_tracked_requests == live, "connector and vLLM disagree on requests"
        for rank in range(len(self.workers) if workers else 0):
            offload_worker(self.harness, rank).check_invariants()

    # ------------------------------------------------------------------ the end
    def finish(self, abort: bool) -> None:
        """End every request (abort or run to completion), drain, check for leaks."""
        scheduler = self.harness.scheduler
        if abort:
            live = [r for r, req in scheduler.requests.items() if not req.is_finished()]
            scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.drain()

    def drain_steps(self) -> None:
        """Step until vLLM is idle; fail if it is still busy after `MAX_DRAIN_STEPS`."""
        for _ in range(MAX_DRAIN_STEPS):
            if not self.harness.is_busy():
                return
            self.step()
        raise AssertionError(f"engine still busy after {MAX_DRAIN_STEPS} steps")

    def drain(self) -> None:
        self.drain_steps()
        assert all(worker.is_idle for worker in self.workers)
        check_quiescent(self.harness)
        assert num_resent(self.harness) == 0, "an output vLLM applied was sent again"

    def audit_tier(self) -> None:
        """Copy every block a tier indexes to the GPU cache of every rank and check it there.

        Each must hold the KV of the token prefix its key hashes (of some request of the
        run), whether or not a later request asks for it. Call when vLLM is idle and its
        GPU cache reset: every GPU block is scratch.
        """
        blocks = {}  # vLLM block hash -> (request, block index)
        for request in self.harness.requests.values():
            for index, block_hash in enumerate(request.block_hashes):
                blocks.setdefault(block_hash, (request, index))
        fingerprints = PrefixFingerprints()
        scratch = range(1, self.harness.cfg.num_gpu_blocks)
        for tier, pool in self.side.offload.index.pools.items():
            keys = {slot: pool.key(slot) for slot in range(1, pool.num_blocks)}
            slots = [slot for slot, key in keys.items() if key is not None]
            for start in range(0, len(slots), len(scratch)):
                batch = tuple(slots[start : start + len(scratch)])
                self.num_audits += 1
                event_id = AUDIT_EVENT_ID + self.num_audits
                job = TransferJob(event_id, tier, Tier.GPU, batch, tuple(scratch[: len(batch)]))
                for worker in self.workers:
                    worker.copy_now(job)
                for slot, gpu_block in zip(batch, scratch, strict=False):
                    self._check_tier_block(
                        f"{tier.value} slot {slot}", keys[slot], blocks, fingerprints, gpu_block
                    )
                self.totals["audited_tier_blocks"] += len(batch)

    def _check_tier_block(
        self,
        what: str,
        key: Key,
        blocks: dict[Any, tuple[Request, int]],
        fingerprints: PrefixFingerprints,
        gpu_block: int,
    ) -> None:
        """Check the tier block of `key`, copied to `gpu_block`, against its prefix.

        The key names the hash block that ends it: in a group of a larger block size, a
        whole block ends at its last hash block, a partial tail (fine-grained hits)
        earlier. A state group's block holds the state of that end's last token.
        """
        group = key_group_id(key)
        request, index = blocks[key_block_hash(key)]
        for cache in self.harness.caches:
            size = cache.block_sizes[group]
            end = (index + 1) * self.harness.cfg.hash_block_size
            first = end - 1 if cache.is_state[group] else (end - 1) // size * size
            table = [0] * (first // size) + [gpu_block]
            prints = fingerprints.upto(request, end)
            cache.check_positions(what, group, table, prints, range(first, end))

    def replay(self) -> None:
        """Serve every prompt again from an empty, zeroed GPU cache: tier blocks must be right."""
        assert self.harness.scheduler.reset_prefix_cache(), "idle, yet the GPU reset failed"
        self.audit_tier()
        for cache in self.harness.caches:
            cache.raw.zero_()
        distinct = {tuple(prompt): request_id for request_id, prompt in self.prompts.items()}
        for prompt, request_id in distinct.items():
            self.harness.add_request(f"again-{request_id}", prompt, max_tokens=1)
        self.drain()
        admissions = self.harness.admissions
        self.totals["replay_hit_tokens"] += sum(
            admissions[f"again-{r}"][1] for r in distinct.values() if f"again-{r}" in admissions
        )

    def _check_tier_events(self) -> None:
        """Check the tiers' published events: a stored one spans what vLLM's GPU event for
        its hash spans (a whole block of its group; a partial key, one ending inside a
        block of its group, its last hash block) with a payload of those tokens or none,
        and all of them, replayed in order (stored +1, removed -1 per hash), name exactly
        the keys each tier's blocks hold now (vLLM is idle: nothing is left unpublished).
        Events a faulted step took are published with a later step's."""
        sizes = [group.block_size for group in self.harness.cfg.groups]
        unit = self.harness.cfg.hash_block_size
        ends: dict[object, int] = {}  # an event's block hash -> the prefix length it hashes
        for request in self.harness.requests.values():
            for index, block_hash in enumerate(request.block_hashes):
                ends.setdefault(maybe_convert_block_hash(block_hash), (index + 1) * unit)
        published: collections.Counter[tuple[str, int, object]] = collections.Counter()
        for event in flatten_events(self.harness.event_batches):
            if getattr(event, "medium", None) not in ("CPU", "STORAGE"):  # GPU, AllBlocksCleared
                continue
            step = 1 if isinstance(event, BlockStored) else -1
            if isinstance(event, BlockStored):
                size = sizes[event.group_idx]
                for block_hash in event.block_hashes:
                    partial = ends[block_hash] % size != 0
                    assert event.block_size == (unit if partial else size), event
                    self.totals["stored_events_partial"] += partial
                assert len(event.token_ids) in (0, event.block_size), event
                self.totals[f"stored_events_{event.medium}"] += 1
                self.totals["stored_events_with_tokens"] += bool(event.token_ids)
            else:
                assert isinstance(event, BlockRemoved), f"not a tier event: {event}"
            for block_hash in event.block_hashes:
                published[(event.medium, event.group_idx, block_hash)] += step
        if not self.side.offload.config.events:
            assert not published, "KV events published with events off"
            return
        held: collections.Counter[tuple[str, int, object]] = collections.Counter()
        for tier, pool in self.side.offload.index.pools.items():
            medium = vllm_medium(tier.value)
            for slot in range(1, pool.num_blocks):
                key = pool.key(slot)
                for k in [key, *pool.secondary_keys(slot)] if key is not None else ():
                    block_hash = maybe_convert_block_hash(key_block_hash(k))
                    held[(medium, key_group_id(k), block_hash)] += 1
        assert min(published.values(), default=0) >= 0, "a tier event removes a key twice"
        assert +published == held, (
            f"the tiers' events describe other keys than they hold: "
            f"{len(held - published)} held unpublished, {len(published - held)} gone unremoved"
        )

    def record_totals(self) -> None:
        admissions = self.harness.admissions
        self.totals["random_hit_tokens"] += sum(
            external for r, (_, external) in admissions.items() if not r.startswith("again-")
        )
        for tier, tokens in self.side.offload.take_stats().hit_tokens.items():
            self.totals[f"hit_tokens_{tier}"] += tokens
        self._check_tier_events()
        for worker in self.workers:
            self.totals.update({f"failed_{k}": n for k, n in worker.num_failed.items()})
            self.totals["jobs_run"] += worker.num_run
            self.totals["jobs_late"] += worker.num_late
        drafter = self.harness.drafter
        if drafter is not None:  # draft tokens the forwards were fed, and accepted
            self.totals.update(drafted=drafter.num_proposed, accepted=drafter.num_accepted)


def run_example(
    engine: Engine, totals: collections.Counter[str], ops: list[object], abort: bool
) -> None:
    """Run one example: apply `ops`, end every request (aborted or not), drain, audit the
    tiers, replay every prompt, and add what it exercised to `totals`."""
    with tempfile.TemporaryDirectory(prefix="kvtier-random-") as disk_dir:
        run = Run(engine, totals, disk_dir)
        try:
            run.check()
            for op in ops:
                run.apply(op)
            run.finish(abort)
            run.replay()
            run.record_totals()
        finally:
            run.close()
