"""Random operations with loads failing by block (`test_vllm_random_ops`' driver).

Besides the random operations of `test_vllm_random_ops` (adds, steps, aborts, resets,
late and failed transfers), a rank's next load may run and then report one of its
blocks bad, naming it (as a disk slot failing its checksum does) with its GPU
destination zeroed: with one full-attention group vLLM keeps the request's tokens
before that block (`get_block_ids_with_load_errors`). The harness raises
`KVMismatchError` for any position vLLM treats as computed whose KV is wrong, so a
block kept at or after a bad one fails the example; the driver checks kvtier's
invariants after every step and that nothing leaks at the end. vLLM's scans for the
requests a load error hits are counted: never a running request (the blocks would be
someone else's), and some waiting ones keep a prefix.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_ops import Engine, FailPart
from random_ops_driver import run_example
from test_vllm_random_ops import OP_KINDS, RANKS
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_engine import KVGroupDef

from example_counts import scaled_examples

OPS = st.sampled_from([*OP_KINDS, *[st.builds(FailPart, RANKS)] * 3]).flatmap(lambda k: k)

ENGINES = [
    Engine("eager"),
    Engine("two_ranks_write_back", cascade="write_back", num_ranks=2),
    Engine("eager_async_pipelined", async_batches=2, num_ranks=2),
    Engine("disk_only", disk_only=True),
    Engine("hybrid", kv_groups=(KVGroupDef(16), KVGroupDef(16, 32)), num_gpu_blocks=32),
]


def explore(engine: Engine, max_examples: int) -> collections.Counter[str]:
    totals: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(ops=st.lists(OPS, min_size=10, max_size=40), abort=st.booleans())
    def example(ops: list[object], abort: bool) -> None:
        run_example(engine, totals, ops, abort)

    example()
    print(engine.name, dict(sorted(totals.items())))
    return totals


def count_scans(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Count the requests vLLM's scans for invalid blocks hit, by kind."""
    scan = Scheduler._update_requests_with_invalid_blocks
    hits: collections.Counter[str] = collections.Counter()

    def counting(
        self: Scheduler,
        requests: Any,
        invalid: set[int],
        scheduled: Any,
        evict_blocks: bool = True,
    ) -> Any:
        requests = list(requests)
        result = scan(self, requests, invalid, scheduled, evict_blocks)
        for request in requests:
            if request.request_id not in result[0]:
                continue
            if evict_blocks:  # the scan of running requests
                hits["running"] += 1
            else:
                hits["kept" if request.num_computed_tokens else "kept_none"] += 1
        return result

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", counting)
    return hits


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.name)
def test_loads_failing_by_block_never_serve_wrong_kv(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    hits = count_scans(monkeypatch)
    totals = explore(engine, max_examples=scaled_examples(20))
    assert totals["failed_load_part"] > 0, "no load failed by block"
    assert totals["random_hit_tokens"] + totals["replay_hit_tokens"] > 0
    print(engine.name, dict(hits))
    assert hits["running"] == 0, "a load error hit a running request"
    if engine.kv_groups:  # two groups: whole failures only
        assert not hits
    else:
        assert hits["kept"] > 0, "no request kept a prefix"
