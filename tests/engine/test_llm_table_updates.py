"""What the offload side is told of a request's block table, step by step.

A new request sends its table whole (`TableUpdate.REPLACE`); from then on each step
sends only the blocks it appended (`APPEND`), as vLLM's scheduler output does.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.config import ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.request import RequestStatus
from kvtier.engine.sampling import SamplingParams
from kvtier.offload.config import OffloadConfig
from kvtier.offload.plan import TransferPlan
from kvtier.offload.protocols import TableUpdate


def test_a_request_sends_its_table_whole_once_then_only_new_blocks() -> None:
    engine = EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=8)
    llm = LLM(None, kv_offload=OffloadConfig(cpu_bytes=8 << 20), engine=engine)
    assert llm.offload is not None
    seen: list[tuple[TableUpdate, tuple[int, ...]]] = []
    build_plan = llm.offload.scheduler.build_plan

    def recording(step: Any) -> TransferPlan:
        seen.extend((s.table_update, tuple(s.block_ids[0])) for s in step.scheduled)
        return build_plan(step)

    llm.offload.scheduler.build_plan = recording  # type: ignore[method-assign]
    # 12 prompt tokens in chunks of 8 and 4, then 6 decode steps: 4 blocks in all.
    (output,) = llm.generate([list(range(12))], SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(output.output_token_ids) == 7
    updates = [update for update, _ in seen]
    assert updates == [TableUpdate.REPLACE] + [TableUpdate.APPEND] * (len(seen) - 1)
    appended = [block for _, ids in seen for block in ids]
    assert len(appended) == len(set(appended)) == 5  # 18 tokens computed: 5 blocks, each once
    llm.shutdown()


def test_a_request_admitted_again_after_a_preemption_sends_its_table_whole() -> None:
    """Blocks of 4, 4 usable: two requests ran (their works applied). The older grows
    into the block the newer needs: the newer is preempted (its tables dropped on the
    offload side). Once the older finishes, the newer is admitted again on its first
    block (a local hit) and one fresh block: its work carries the whole table
    (REPLACE), hit block first, though its earlier works were all applied.
    Mutation: a preemption left `needs_full_table` unset (APPEND of the fresh block
    only: the offload side would take it for the table's first position)."""
    llm = LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=5))
    scheduler = llm.scheduler
    older = llm.add_request(list(range(7)), SamplingParams(max_tokens=4, ignore_eos=True))
    newer = llm.add_request(list(range(20, 24)), SamplingParams(max_tokens=9, ignore_eos=True))
    steps = []
    for _ in range(5):
        step = scheduler.schedule()
        steps.append(step)
        scheduler.complete(step, [1] * len(step.work), 0.0)
    assert steps[2].preempted_ids == {newer.request_id}
    assert older.status is RequestStatus.FINISHED
    (work,) = steps[4].work
    assert (work.request, work.num_new_tokens) == (newer, 2)
    assert work.table_update is TableUpdate.REPLACE
    assert work.new_block_ids == tuple(map(tuple, newer.block_tables))
