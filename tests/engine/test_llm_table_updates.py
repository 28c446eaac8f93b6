"""What the offload side is told of a request's block table, step by step.

A new request sends its table whole (`TableUpdate.REPLACE`); from then on each step
sends only the blocks it appended (`APPEND`), as vLLM's scheduler output does.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.llm import LLM, EngineConfig
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
