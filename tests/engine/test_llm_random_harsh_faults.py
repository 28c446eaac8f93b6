"""Property: random workloads give the same tokens under a harsh, asynchronous fault model.

The workloads are those of `test_llm_random_workloads` (see `random_workloads`); the
offload worker is wrapped so that, drawn per example:

- each finished load fails with probability `p_fail_load`, and its GPU destination
  blocks are overwritten with garbage first; each finished store or demotion fails with
  probability `p_fail_store`;
- each report (done or failed) is held back for a random number of polls, as a legal
  asynchronous worker may report late;
- up to half the disk slots (at least 4) are bad: a load from one fails naming the
  slot (`bad_blocks`), and only that slot's GPU block is overwritten; optionally stores
  into one fail too;
- before a random engine step the tier is reset, and the reset retried on each later
  step until the scheduler accepts it.

The offload scheduler's invariants must hold after every engine step, and every output
must match the engine with offload off: the same tokens, logits within 1e-4. Across the
run, every kind of fault must really happen and the tiers must still serve hits.
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_workloads import MAX_STEPS_PER_CALL, MODELS, Workload, plan_submissions, workloads
from step_watchdog import with_watchdog
from workload_runner import generate_both, offload_config

from kvtier.engine.llm import LLM, EngineConfig, RequestOutput
from kvtier.offload.plan import TransferPlan, WorkerReport

GARBAGE = 1e3


class HarshWorker:
    """Wrap an offload worker: fail finished jobs at random, hold reports back, bad slots."""

    def __init__(self, worker: Any, llm: LLM, rng: random.Random, faults: dict[str, Any]) -> None:
        self.worker = worker
        self.kv_tensors = llm.runner.kv_tensors
        self.rng = rng
        self.faults = faults
        self.jobs: dict[int, Any] = {}
        self.held = WorkerReport()
        self.held_bad: dict[int, frozenset[int]] = {}
        self.counts = Counter[str]()

    def submit(self, plan: TransferPlan) -> None:
        for job in plan.jobs:
            self.jobs[job.event_id] = job
        self.worker.submit(plan)
        if self.faults["synchronous"]:
            self.worker.flush()

    def _scribble(self, block_ids: Any) -> None:
        for block_id in block_ids:
            for layer in self.kv_tensors:
                layer[:, block_id] = GARBAGE

    def _fail(self, event_id: int, bad: dict[int, frozenset[int]]) -> bool:
        """Decide whether finished job `event_id` fails; scribble as its failure would."""
        job = self.jobs[event_id]
        bad_slots = self.faults["bad_slots"]
        writes_bad_slot = job.dst_tier.value == "DISK" and bad_slots & set(job.dst_block_ids)
        if writes_bad_slot and self.faults["bad_writes"]:
            self.counts["bad_store"] += 1
            return True
        if job.src_tier.value == "DISK" and bad_slots & set(job.src_block_ids):
            bad[event_id] = frozenset(bad_slots & set(job.src_block_ids))
            if job.dst_tier.value == "GPU":
                pairs = zip(job.src_block_ids, job.dst_block_ids, strict=True)
                self._scribble(dst for src, dst in pairs if src in bad[event_id])
            self.counts["bad_load"] += 1
            return True
        if self.rng.random() < self.faults["p_fail_load" if job.is_load else "p_fail_store"]:
            if job.is_load:
                self._scribble(job.dst_block_ids)
            self.counts["load" if job.is_load else "store"] += 1
            return True
        return False

    def peek(self) -> WorkerReport:
        report = self.worker.peek()
        done = {**self.held.done, **report.done}
        failed = {**self.held.failed, **report.failed}
        bad = dict(self.held_bad)
        held_done = {
            e: done.pop(e) for e in list(done) if self.rng.random() < self.faults["p_hold"]
        }
        for event_id in list(done):
            if event_id in self.jobs and self._fail(event_id, bad):
                failed[event_id] = done.pop(event_id)
        held_failed = {
            e: failed.pop(e) for e in list(failed) if self.rng.random() < self.faults["p_hold"]
        }
        self.held = WorkerReport(done=held_done, failed=held_failed)
        self.held_bad = {e: slots for e, slots in bad.items() if e in held_failed}
        for event_id in (*done, *failed):
            self.jobs.pop(event_id, None)
        bad_blocks = {e: slots for e, slots in bad.items() if e in failed}
        return WorkerReport(done=done, failed=failed, bad_blocks=bad_blocks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def fault_models(workload: Workload) -> st.SearchStrategy[dict[str, Any]]:
    """Fault probabilities, bad disk slots, and a seed for the per-poll coin flips."""
    rates = st.sampled_from([0.0, 0.2, 0.5, 1.0])
    return st.fixed_dictionaries(
        {
            "seed": st.integers(0, 2**32),
            "p_fail_load": rates,
            "p_fail_store": rates,
            "p_hold": st.sampled_from([0.0, 0.3, 0.7]),
            "p_reset": st.sampled_from([0.0, 0.05, 0.2]),
            "bad_slots": st.frozensets(
                st.integers(1, workload.disk_blocks - 1),
                min_size=1,
                max_size=max(4, workload.disk_blocks // 2),
            ),
            "bad_writes": st.sampled_from([False, False, True]),  # else loads rarely see one
            "synchronous": st.just(workload.synchronous),
        }
    )


def serve_harshly(workload: Workload, faults: dict[str, Any], totals: Counter[str]) -> None:
    """Serve `workload` with offload off and on (harsh worker); compare every output."""
    model = MODELS[workload.model]
    calls = plan_submissions(workload)
    longest = max(sub.num_tokens for call in calls for sub in call) - 1
    blocks_per_group = -(-longest // workload.block_size)
    engine = EngineConfig(
        block_size=workload.block_size,
        num_gpu_blocks=len(model.layer_groups()) * blocks_per_group + 1 + workload.gpu_slack_blocks,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        keep_logits=True,
    )
    rng = random.Random(faults["seed"])
    with tempfile.TemporaryDirectory(prefix="kvtier-harsh-") as disk_path:
        bytes_per_block = model.kv_bytes_per_token() * workload.block_size
        config = offload_config(workload, bytes_per_block, disk_path)
        with LLM(model, engine=engine) as reference:
            llm = LLM(model, config, engine)
            offload = llm.offload
            assert offload is not None
            try:
                worker = HarshWorker(offload.worker, llm, rng, faults)
                offload.worker = worker
                step = llm.step
                reset_pending = [False]

                def harsh_step() -> Any:
                    if reset_pending[0] or rng.random() < faults["p_reset"]:
                        reset_pending[0] = not offload.scheduler.reset()
                        totals["resets"] += 1
                    out = step()
                    offload.scheduler.check_invariants()
                    return out

                llm.step = harsh_step  # type: ignore[method-assign]
                arm = with_watchdog(llm, MAX_STEPS_PER_CALL)
                finished: list[RequestOutput] = []
                for call in calls:
                    outputs = generate_both(call, finished, reference, llm, arm)
                    totals["hit_tokens"] += sum(o.num_external_hit_tokens for o in outputs)
                faults["p_reset"] = 0.0  # let drain finish
                arm()
                llm.drain()
                offload.scheduler.check_invariants()
                for kind in ("load", "store", "bad_load", "bad_store"):
                    totals[f"failed_{kind}s"] += worker.counts[kind]
            finally:
                offload.shutdown()


def test_random_workloads_match_offload_off_under_harsh_faults() -> None:
    """Same tokens through the tiers while jobs fail, reports lag, slots rot and tiers reset."""
    totals: Counter[str] = Counter()

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.data(), workloads())
    def check(data: st.DataObject, workload: Workload) -> None:
        serve_harshly(workload, data.draw(fault_models(workload)), totals)

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_llm_random_workloads
    try:
        check()
    finally:
        torch.set_num_threads(num_threads)
    print(dict(totals))
    assert totals["hit_tokens"] > 0, totals
    for kind in ("loads", "stores", "bad_loads", "bad_stores"):
        assert totals[f"failed_{kind}"] > 0, totals
    assert totals["resets"] > 0, totals
