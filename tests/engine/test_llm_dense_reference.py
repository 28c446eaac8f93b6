"""Property: every request's greedy tokens are those of a dense decode of its prompt alone.

The other end-to-end properties compare the engine with tiers against the same engine
without them, so a scheduling slip both share (a preemption, a chunk boundary, a full
prompt hit, a stop) passes them. Here the oracle is `dense_logits`: each prompt decoded
alone, unpaged and unbatched. Hypothesis draws what those properties keep fixed: EOS and
stop tokens (requests stop early, at their first token too), `max_num_seqs` of 1 or 2,
token budgets below the block size, GPU pools at the peak one request needs, models
whose sliding window comes first or spans one token (beside full attention or alone),
prompts an exact number of blocks long, and tiers off, CPU or disk, with a worker that
holds reports back and fails a job load now and then (its failed loads scribble over
their GPU blocks). Each workload runs three times, shuffled, so later rounds hit the GPU
cache and the tier. After it, every GPU block is free (nothing leaked) and the offload
scheduler's invariants hold.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
from engine_helpers import dense_logits
from fail_next_worker import FailNext
from hypothesis import given, settings
from hypothesis import strategies as st
from random_workloads import WORKLOAD_SETTINGS
from step_watchdog import with_watchdog
from workload_runner import kv_group_spec, on_one_thread

from kvtier.core.kv_groups import KVLayout
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.model import DecoderModel, build_model
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.validation import num_peak_blocks
from kvtier.offload.config import DiskIOMode, OffloadConfig, StoreMode

EOS = 46  # a token these random models often pick
_HYBRID = ModelConfig.tiny_hybrid()
MODELS = {
    "full": ModelConfig.tiny(),
    "hybrid": _HYBRID,
    "sliding-first-w5": dataclasses.replace(
        _HYBRID, layer_kinds=(AttentionKind.SLIDING, AttentionKind.FULL), sliding_window=5
    ),
    "hybrid-w1": dataclasses.replace(_HYBRID, sliding_window=1),
    "sliding-only-w1": dataclasses.replace(
        _HYBRID, layer_kinds=(AttentionKind.SLIDING,) * 2, sliding_window=1
    ),
}
PROMPT_VOCAB = 8  # prompts from few ids share prefixes
MAX_STEPS = 20_000  # a stuck engine fails the example instead of hanging pytest


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn workload and the engine that serves it."""

    model: str
    block_size: int
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    order: tuple[int, ...]  # the second round's (the third's reversed)
    filler: tuple[int, ...]  # a prompt of other ids run before each later round
    max_num_seqs: int
    max_num_batched_tokens: int
    peak_pool: bool  # the peak one request needs, else every block of the longest
    gpu_slack_blocks: int
    tier: str
    tier_blocks: int
    store_mode: StoreMode
    slow: int
    fail_every: int  # fail the next job every that many steps (0: never)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Return a workload of 2-10 prompts over 1-3 shared prefixes (see the module)."""
    block_size = draw(st.sampled_from([2, 4]))
    # Lengths of whole blocks (full prompt hits) and others.
    lengths = st.sampled_from([block_size, 2 * block_size, 3 * block_size, 5, 9])
    ids = st.integers(0, PROMPT_VOCAB - 1)
    prefix = lengths.flatmap(lambda n: st.lists(ids, min_size=n, max_size=n))
    prefixes = draw(st.lists(prefix, min_size=1, max_size=3))
    prompts, params = [], []
    for _ in range(draw(st.integers(2, 10))):
        tail = draw(st.lists(ids, max_size=draw(st.sampled_from([0, 0, 1, block_size]))))
        prompts.append((*draw(st.sampled_from(prefixes)), *tail) or (1,))
        stop = draw(st.sampled_from([(), (), (EOS,), (2,), (64, 99, 105)]))
        params.append(
            SamplingParams(
                max_tokens=draw(st.integers(1, 8)),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=stop,
            )
        )
    # A filler as long as the longest prompt evicts the prefixes from a tight GPU pool.
    longest = max(map(len, prompts))
    return Case(
        model=draw(st.sampled_from(sorted(MODELS))),
        block_size=block_size,
        prompts=tuple(prompts),
        params=tuple(params),
        order=tuple(draw(st.permutations(range(len(prompts))))),
        filler=tuple(draw(st.lists(st.integers(64, 127), min_size=longest, max_size=longest))),
        max_num_seqs=draw(st.sampled_from([1, 2, 32])),
        max_num_batched_tokens=draw(st.sampled_from([1, 3, 7, 64])),
        peak_pool=draw(st.booleans()),
        gpu_slack_blocks=draw(st.integers(0, 2)),
        tier=draw(st.sampled_from(["cpu", "disk", "off"])),
        tier_blocks=draw(st.integers(6, 24)),
        store_mode=draw(st.sampled_from(list(StoreMode))),
        slow=draw(st.sampled_from([1, 1, 3])),
        fail_every=draw(st.sampled_from([0, 2, 5])),
    )


def dense_decode(model: DecoderModel, prompt: tuple[int, ...], params: SamplingParams) -> Any:
    """Return the greedy tokens and logits of `prompt` decoded alone, without a cache."""
    tokens, outputs, rows = list(prompt), [], []
    for _ in range(params.max_tokens):
        row = dense_logits(model, tokens)[-1]
        token = int(row.argmax())
        outputs.append(token)
        rows.append(row)
        if token in params.stop_token_ids or (not params.ignore_eos and token == EOS):
            break
        tokens.append(token)
    return tuple(outputs), torch.stack(rows)


def make_engine(case: Case, config: ModelConfig, disk_path: str) -> LLM:
    """Return the engine `case` describes, its worker wrapped to be slow or fail."""
    pairs = zip(case.prompts, case.params, strict=True)
    longest = max(len(prompt) + sp.max_tokens for prompt, sp in pairs) - 1  # last: not fed
    groups = config.layer_groups()
    needed = len(groups) * -(-longest // case.block_size)
    if case.peak_pool:
        specs = tuple(kv_group_spec(group, case.block_size) for group in groups)
        needed = num_peak_blocks(KVLayout(specs), longest)
    engine = EngineConfig(
        block_size=case.block_size,
        num_gpu_blocks=needed + 1 + case.gpu_slack_blocks,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        keep_logits=True,
    )
    if case.tier == "off":
        return LLM(config, engine=engine)
    num_bytes = case.tier_blocks * config.kv_bytes_per_token() * case.block_size
    sizes: dict[str, Any] = (
        {"cpu_bytes": num_bytes}
        if case.tier == "cpu"
        else {"disk_bytes": num_bytes, "disk_path": disk_path}
    )
    offload = OffloadConfig(
        disk_io_mode=DiskIOMode.PAGE_CACHE,  # tmpfs may refuse O_DIRECT
        store_mode=case.store_mode,
        max_batched_tokens=case.max_num_batched_tokens,
        **sizes,
    )
    llm = LLM(config, offload, engine)
    assert llm.offload is not None
    faults = FailNext(llm.offload.worker, llm, False, case.slow, loads_only=True)
    llm.offload.worker = faults
    if case.fail_every:
        step, num_steps = llm.step, [0]

        def failing_step() -> Any:
            num_steps[0] += 1
            faults.armed = faults.armed or num_steps[0] % case.fail_every == 0
            return step()

        llm.step = failing_step  # type: ignore[method-assign]
    return llm


def run_case(case: Case) -> None:
    """Serve `case` three times; compare every output with its dense decode; check for leaks."""
    config = dataclasses.replace(MODELS[case.model], eos_token_ids=(EOS,))
    model = build_model(config, seed=0)  # the engine's weights: EngineConfig.seed is 0
    prompts = (*case.prompts, case.filler)
    params = (*case.params, SamplingParams(max_tokens=1))
    expected = [dense_decode(model, p, sp) for p, sp in zip(prompts, params, strict=True)]
    filler = len(case.prompts)
    with tempfile.TemporaryDirectory(prefix="kvtier-dense-") as disk_path:
        llm = make_engine(case, config, disk_path)
        arm = with_watchdog(llm, MAX_STEPS)
        try:
            rounds = (range(len(case.prompts)), (filler,), case.order, (filler,), case.order[::-1])
            for order in rounds:
                arm()
                outputs = llm.generate([prompts[i] for i in order], [params[i] for i in order])
                for index, output in zip(order, outputs, strict=True):
                    tokens, logits = expected[index]
                    assert output.output_token_ids == tokens, (index, output)
                    assert output.logits is not None
                    assert torch.allclose(output.logits, logits, atol=1e-4, rtol=0), index
            arm()
            llm.drain()
            assert not llm.scheduler.has_unfinished()
            assert llm.pool.num_free() == llm.pool.num_usable_blocks, "GPU blocks leaked"
            if llm.offload is not None:
                llm.offload.scheduler.check_invariants()
        finally:
            if llm.offload is not None:
                llm.offload.shutdown()


def test_outputs_match_a_dense_decode_of_each_prompt_alone() -> None:
    @settings(max_examples=40, **WORKLOAD_SETTINGS)
    @given(cases())
    def check(case: Case) -> None:
        run_case(case)

    on_one_thread(check)
