"""What `LLM` refuses up front: bad configs, arguments, prompts and impossible requests.

Regressions: each of these used to be accepted and then fail deep inside a step (after
compute was spent), poison the engine for later calls, or hang.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine import runner as runner_module
from kvtier.engine.config import AttentionKind, ModelConfig
from kvtier.engine.llm import LLM, EngineConfig
from kvtier.engine.runner import KVCacheTooLargeError
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.validation import num_peak_blocks
from kvtier.offload.config import ConfigError, DiskIOMode, OffloadConfig

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
SMALL = EngineConfig(block_size=4, num_gpu_blocks=5)  # 4 usable blocks: 16 tokens


def small_llm(model: ModelConfig | None = None, engine: EngineConfig = SMALL) -> LLM:
    """Return an engine without offloading over a tiny random model."""
    return LLM(model, engine=engine)


def assert_untouched(llm: LLM) -> None:
    """Check nothing was queued or computed, and the engine still serves."""
    assert llm.stats.num_steps == 0
    assert not llm.scheduler.has_unfinished()
    assert llm.generate([[1, 2, 3]], PARAMS)[0].output_token_ids == (57, 76, 2)


# ---------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be a positive int, got 0$"),
        ({"max_num_seqs": 2.0}, TypeError, "EngineConfig.max_num_seqs must be a positive int"),
        ({"max_num_batched_tokens": -5}, ValueError, "max_num_batched_tokens must be a positive"),
        ({"max_num_batched_tokens": "8"}, TypeError, "max_num_batched_tokens must be a positive"),
        ({"block_size": True}, TypeError, "EngineConfig.block_size must be a positive int"),
        ({"num_gpu_blocks": 1}, ValueError, "num_gpu_blocks=1 leaves no block besides the null"),
        ({"seed": "x"}, TypeError, "EngineConfig.seed must be an int, got 'x'"),
        ({"seed": 2**64}, ValueError, "EngineConfig.seed must be in"),
        # torch seeds -1 as 2**64 - 1: two seeds would give one model (and -1 is
        # vLLM's "no seed" in SamplingParams).
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\), got -1 \(torch would"),
        ({"seed": -(2**63)}, ValueError, r"EngineConfig.seed must be in \[0, 2\*\*64\), got -"),
        ({"keep_logits": "no"}, TypeError, "EngineConfig.keep_logits must be a bool, got 'no'"),
        ({"max_logprobs": 2.0}, TypeError, "EngineConfig.max_logprobs must be an int, got 2.0"),
        ({"max_logprobs": -2}, ValueError, r"max_logprobs must be >= 0, or -1 \(no cap\), got -2"),
        ({"device": "bogus"}, ValueError, "EngineConfig.device='bogus' is not a torch device"),
        ({"device": 0}, TypeError, "EngineConfig.device must be a str or torch.device, got 0"),
        ({"device": "meta"}, ValueError, "device='meta': the engine runs on 'cpu' or 'cuda"),
        ({"device": torch.device("meta")}, ValueError, "device='meta': the engine runs on"),
    ],
)
def test_invalid_engine_config_names_the_field(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        EngineConfig(**changes)


def test_a_cpu_kv_cache_larger_than_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU device the "GPU" pool is host memory: one above it names the field.

    The tiny model's tokens take 2 layers x K,V x 2 heads x 16 dims x 4 bytes = 512 B, so
    64 blocks of 4 tokens need 131072 B; the machine here reports 131071.
    """
    monkeypatch.setattr(runner_module, "total_memory_bytes", lambda: 131071)
    with pytest.raises(
        KVCacheTooLargeError,
        match=r"EngineConfig\.num_gpu_blocks=64: the KV cache needs 131072 bytes \(64 blocks x 4 "
        r"tokens x 512 bytes\), more than this machine's memory .*\(131071 bytes\)",
    ):
        LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=64))
    monkeypatch.setattr(runner_module, "total_memory_bytes", lambda: 131072)
    LLM(ModelConfig.tiny(), engine=EngineConfig(block_size=4, num_gpu_blocks=64)).shutdown()


def test_a_cuda_device_index_beyond_the_machine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cuda:5` on a machine with 2 GPUs names the field instead of failing in torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device='cuda:5', but this machine has 2 CUDA device"):
        EngineConfig(device="cuda:5")
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match=r"device='cuda:5', but this machine has 2 CUDA device"):
        EngineConfig(device=torch.device("cuda", 5))
    assert EngineConfig(device=torch.device("cuda", 1)).device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # not "1 CUDA device(s)"
    with pytest.raises(ValueError, match=r"this machine has 1 CUDA device \(cuda:0 \.\.\.\)"):
        EngineConfig(device="cuda:1")


def test_a_torch_device_is_taken_as_its_str() -> None:
    """Regression: EngineConfig(device=torch.device("cpu")) was refused as 'must be a str'."""
    config = EngineConfig(block_size=4, num_gpu_blocks=5, device=torch.device("cpu"))
    assert config == SMALL
    assert type(config.device) is str
    (output,) = small_llm(engine=config).generate([[1, 2, 3]], PARAMS)
    assert output.output_token_ids == (57, 76, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.device='cuda', but CUDA is not available"):
        EngineConfig(device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": 123}, "model must be a local checkpoint directory .* got 123"),
        ({"kv_offload": {"cpu_bytes": 1 << 20}}, "kv_offload must be an OffloadConfig .*from_dict"),
        ({"engine": {"block_size": 4}}, "engine must be an EngineConfig or None, got dict"),
    ],
)
def test_llm_arguments_of_the_wrong_type(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        LLM(**kwargs)


def test_disk_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    """It used to fail in the storage layer with a raw NotADirectoryError."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    config = OffloadConfig(
        disk_bytes=1 << 20, disk_path=str(afile), disk_io_mode=DiskIOMode.PAGE_CACHE
    )
    with pytest.raises(ConfigError, match=r"disk_path=.*afile' is not a directory"):
        LLM(None, kv_offload=config, engine=SMALL)


# ---------------------------------------------------------------- prompts and params


@pytest.mark.parametrize(
    "prompt",
    [np.array([1, 2, 3]), torch.tensor([1, 2, 3]), (1, 2, 3), [np.int64(1), 2, np.int32(3)]],
    ids=["numpy", "torch", "tuple", "numpy-ints"],
)
def test_prompts_may_be_integer_arrays(prompt: Any) -> None:
    (output,) = small_llm().generate([prompt], PARAMS)
    assert output.prompt_token_ids == [1, 2, 3]
    assert output.output_token_ids == (57, 76, 2)


@pytest.mark.parametrize("prompt", [[1, 2, 3], [np.int64(1), 2, 3]], ids=["list", "numpy-ints"])
def test_a_flat_list_of_ints_is_one_prompt_as_in_vllm(prompt: Any) -> None:
    """Regression: refused as "a flat list of ints", where vLLM 0.33's `generate([1, 2, 3])`
    runs one prompt (`prompt_to_seq`); code written for vLLM failed."""
    (output,) = small_llm().generate(prompt, PARAMS)
    assert output.prompt_token_ids == [1, 2, 3]
    assert output.output_token_ids == small_llm().generate([[1, 2, 3]], PARAMS)[0].output_token_ids


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([1, [2], 3], r"prompt 0: token 1 is \[2\], not an int token id"),
        (np.array([1, 2, 3]), r"got a 1-D ndarray: pass generate\(\[ids.tolist\(\)\]\) for one"),
        (np.array([[1, 2], [3, 4]]), r"got a 2-D ndarray: pass generate\(ids.tolist\(\)\), one"),
        (torch.tensor([[1, 2]]), r"got a 2-D Tensor: pass generate\(ids.tolist\(\)\), one prompt"),
        ("abc", r"lists or TokensPrompt dicts\), got 'abc' \(str\): the engine takes token"),
        (7, r"prompts must be a list of prompts \(token id lists or TokensPrompt dicts\)"),
        ((1, 2, 3), r"got a tuple of token ids \(1, 2, 3\) \(tuple\): as in vLLM, only a list"),
        (range(4), r"got a range of token ids range\(0, 4\) \(range\): .* pass list\(ids\) or"),
        (7, r"or one prompt, got 7 \(int\): pass \[\[1, 2, 3\]\] or \[{'prompt_token_ids'"),
        (["abc"], "prompt 0 is a str: the engine takes token ids, not text"),
        ([[1, 2], None], "prompt 1 must be a sequence of token ids, got None"),
        ([[1, 1.5, 3]], "prompt 0: token 1 is 1.5, not an int token id"),
        ([[True, False]], "prompt 0: token 0 is True, not an int token id"),
        ([np.array([[1, 2]])], "prompt 0 must be a 1-D integer array of token ids, got 2-D"),
        ([torch.tensor([1.0, 2.0])], "prompt 0 must be a 1-D integer array .* torch.float32"),
        ([torch.tensor([True, False])], "prompt 0 must be a 1-D integer array .* torch.bool"),
        ([np.array([1.7, 2.2])], "prompt 0 must be a 1-D integer array .* float64"),
        ([np.array([True, False])], "prompt 0 must be a 1-D integer array .* bool"),
    ],
)
def test_prompts_of_the_wrong_type(prompts: Any, message: str) -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, PARAMS)
    assert_untouched(llm)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (5, TypeError, "params must be a SamplingParams, a sequence of them .* got 5"),
        ({"max_tokens": 2}, TypeError, "params must be a SamplingParams"),
        ([PARAMS, "x"], TypeError, r"params\[1\] must be a SamplingParams, got 'x'"),
        ([PARAMS], ValueError, "2 prompts but 1 sampling param$"),
    ],
)
def test_params_of_the_wrong_type(params: Any, error: type[Exception], message: str) -> None:
    llm = small_llm()
    with pytest.raises(error, match=message):
        llm.generate([[1, 2, 3], [4, 5]], params)
    assert_untouched(llm)


def test_one_prompt_with_two_params_is_named_in_the_singular() -> None:
    """Regression: "1 prompts but 2 sampling params"."""
    llm = small_llm()
    with pytest.raises(ValueError, match=r"^1 prompt but 2 sampling params$"):
        llm.generate([[1, 2, 3]], [PARAMS, PARAMS])
    assert_untouched(llm)


def test_add_request_checks_its_params() -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match="params must be a SamplingParams, got None"):
        llm.add_request([1, 2, 3], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request req-0: token ids \\[200\\] outside the vocab"):
        llm.add_request([1, 200], PARAMS)
    with pytest.raises(TypeError, match="session_id must be a str or None, got 7"):
        llm.add_request([1, 2], PARAMS, session_id=7)  # type: ignore[arg-type]
    assert_untouched(llm)
    assert llm.add_request([1, 2], PARAMS, session_id="chat-1").session_id == "chat-1"


@pytest.mark.parametrize(
    ("session_ids", "error", "message"),
    [
        (["a"], ValueError, "one id per prompt \\(2\\), got \\['a'\\]"),
        ("ab", TypeError, "a sequence of str or None, got 'ab'"),
        (7, TypeError, "a sequence of str or None, got 7"),
        (["a", 3], TypeError, "session_id must be a str or None, got 3"),
    ],
)
def test_generate_checks_its_session_ids(session_ids: Any, error: type, message: str) -> None:
    llm = small_llm()
    with pytest.raises(error, match=message):
        llm.generate([[1, 2, 3], [4, 5]], PARAMS, session_ids=session_ids)
    assert_untouched(llm)


def test_generate_gives_each_request_its_session_id(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = small_llm()
    queued: list[str | None] = []
    enqueue = llm._enqueue

    def spy(*args: Any) -> Any:
        request = enqueue(*args)
        queued.append(request.session_id)
        return request

    monkeypatch.setattr(llm, "_enqueue", spy)
    llm.generate([[1, 2, 3], [4, 5], [6]], PARAMS, session_ids=["chat-1", None, "chat-2"])
    assert queued == ["chat-1", None, "chat-2"]


# ---------------------------------------------------------------- impossible requests


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([[1, 2, 128]], PARAMS, r"prompt 0: token ids \[128\] outside the vocab \[0, 128\)"),
        ([[1, -1]], PARAMS, r"prompt 0: token ids \[-1\] outside the vocab"),
        ([[1, 2, 3], []], PARAMS, "prompt 1: empty prompt"),
        (
            [[1, 2, 3], list(range(40))],
            SamplingParams(max_tokens=4, ignore_eos=True),
            "prompt 1: prompt of 40 tokens \\+ max_tokens=4 needs at least 11 KV blocks at one "
            "step, more than the GPU pool's 4 usable blocks",
        ),
        (
            [list(range(14))],
            SamplingParams(max_tokens=8, ignore_eos=True),
            "prompt 0: prompt of 14 tokens \\+ max_tokens=8 needs at least 6 KV blocks",
        ),
    ],
)
def test_a_call_with_an_impossible_prompt_runs_nothing(
    prompts: list[list[int]], params: SamplingParams, message: str
) -> None:
    """The whole call is refused before any request is queued; the engine stays usable."""
    llm = small_llm()
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert_untouched(llm)


def test_a_prompt_longer_than_max_position_is_named_by_its_length() -> None:
    """Regression: a prompt longer than the model was named by its sum with max_tokens.
    A prompt plus max_tokens beyond it runs, cut there (test_llm_max_model_len.py)."""
    model = dataclasses.replace(ModelConfig.tiny(), max_position=16)
    llm = small_llm(model, EngineConfig(block_size=4, num_gpu_blocks=64))
    with pytest.raises(
        ValueError, match=r"^prompt 0: prompt of 17 tokens is longer than the model's max_posit"
    ):
        llm.generate([list(range(17))], SamplingParams(max_tokens=1))
    assert_untouched(llm)
    # The last sampled token takes no position: 13 + 4 - 1 = 16 positions fit exactly.
    (output,) = llm.generate([list(range(13))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.output_token_ids) == 3  # 16 tokens in all: max_position, as vLLM


def test_requests_that_exactly_fill_the_pool_still_run() -> None:
    """The up-front pool check is a lower bound: it never refuses a request that fits."""
    full = small_llm().generate([list(range(13))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(full[0].output_token_ids) == 4  # 16 tokens in 4 blocks
    # Hybrid (window 8): at the last step the full group holds 6 blocks, the sliding 3.
    hybrid = ModelConfig.tiny_hybrid()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tight = small_llm(hybrid, EngineConfig(block_size=4, num_gpu_blocks=10))
    roomy = small_llm(hybrid, EngineConfig(block_size=4, num_gpu_blocks=64))
    expected = roomy.generate([[1, 2, 3, 4]], params)[0].output_token_ids
    assert tight.generate([[1, 2, 3, 4]], params)[0].output_token_ids == expected


def test_num_peak_blocks_per_group_kind() -> None:
    full = KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64)
    sliding = KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, sliding_window=8)
    assert num_peak_blocks(KVLayout((full,)), 23) == 6
    assert num_peak_blocks(KVLayout((full, sliding)), 23) == 6 + 3
    assert num_peak_blocks(KVLayout((full, sliding)), 5) == 2 + 2  # window not yet full


def test_num_peak_blocks_counts_a_window_that_starts_within_a_block() -> None:
    # Window 8 in blocks of 16: position 19's window (12..19) spans blocks 0 and 1,
    # position 31's (24..31) block 1 only. Regression: only the last position counted.
    full = KVGroupSpec(GroupKind.FULL_ATTENTION, 16, 64)
    sliding = KVGroupSpec(GroupKind.SLIDING_WINDOW, 16, 64, sliding_window=8)
    assert num_peak_blocks(KVLayout((full, sliding)), 32) == 2 + 2
    # Window 5 in blocks of 4: 5 tokens span 2 blocks at most (3..7, 4..8), never 3.
    # Mutation: a window of one token more (from position - 5) counted 3.
    narrow = KVGroupSpec(GroupKind.SLIDING_WINDOW, 4, 64, sliding_window=5)
    assert num_peak_blocks(KVLayout((narrow,)), 16) == 2
    # Blocks of 4 and of 16: the peak may lie up to 16 positions back (position 22: 6 full
    # blocks and 2 per window; 31: 8 and 1). Mutation: the last 4 positions only gave 11.
    small = KVGroupSpec(GroupKind.FULL_ATTENTION, 4, 64)
    assert num_peak_blocks(KVLayout((small, sliding, sliding, sliding)), 32) == 6 + 3 * 2


@pytest.mark.parametrize("first", [AttentionKind.FULL, AttentionKind.SLIDING])
def test_a_request_validation_accepts_runs_in_the_smallest_pool_it_allows(
    first: AttentionKind,
) -> None:
    """Regression: `num_peak_blocks` counted the blocks at the last position only, so a
    hybrid model's request could pass `add_request` and be aborted part-way ("no
    progress possible"), e.g. 32 tokens in blocks of 16 with a window of 8 and 3 blocks."""
    for window, block_size in itertools.product((3, 5, 7), (2, 3, 4)):
        model = dataclasses.replace(
            ModelConfig.tiny(),
            layer_kinds=(first, AttentionKind.SLIDING),
            sliding_window=window,
        )
        layout = small_llm(model, EngineConfig(block_size=block_size)).layout
        for num_prompt, max_tokens in itertools.product(range(1, 14, 2), (1, 3)):
            need = num_peak_blocks(layout, num_prompt + max_tokens - 1)
            engine = EngineConfig(block_size=block_size, num_gpu_blocks=need + 1)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            (out,) = small_llm(model, engine).generate([list(range(num_prompt))], params)
            assert len(out.output_token_ids) == max_tokens
            if need > 1:  # one block less is refused up front
                tighter = EngineConfig(block_size=block_size, num_gpu_blocks=need)
                with pytest.raises(ValueError, match=f"needs at least {need} KV blocks"):
                    small_llm(model, tighter).generate([list(range(num_prompt))], params)


def test_engine_config_takes_numpy_integers_as_python_ones() -> None:
    """Regression: EngineConfig(block_size=np.int64(16)) was refused as 'must be a positive
    int, got np.int64(16)', as SamplingParams was until 00dc857."""
    config = EngineConfig(
        block_size=np.int64(16),  # type: ignore[arg-type]
        num_gpu_blocks=np.int32(64),  # type: ignore[arg-type]
        max_num_seqs=np.uint8(4),  # type: ignore[arg-type]
        max_num_batched_tokens=np.int16(128),  # type: ignore[arg-type]
        seed=np.uint64(2**63),  # type: ignore[arg-type]
    )
    assert (config.block_size, config.num_gpu_blocks, config.seed) == (16, 64, 2**63)
    assert all(type(v) is int for v in dataclasses.astuple(config)[:4])
    assert type(config.seed) is int
    for field, value, error in [
        ("block_size", np.True_, TypeError),
        ("num_gpu_blocks", np.float64(64.0), TypeError),
        ("max_num_seqs", np.int64(0), ValueError),
        ("seed", np.float32(1.0), TypeError),
    ]:
        with pytest.raises(error, match=field):
            EngineConfig(**{field: value})
