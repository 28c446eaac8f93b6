"""`kvtier demo` on a small checkpoint, and bad paths named before anything is served."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from engine_helpers import TINY_HF_CONFIG
from matplotlib.figure import Figure
from safetensors.torch import save_file

from kvtier.cli import demo
from kvtier.cli.demo_checks import check_sizes
from kvtier.cli.main import main
from kvtier.core.kv_groups import GroupKind, KVGroupSpec, KVLayout
from kvtier.engine.chat_workload import ChatWorkload
from kvtier.engine.config import ModelConfig
from kvtier.engine.model import build_model
from kvtier.offload.config import DiskIOMode, OffloadConfig

SMALL_RUN = [  # one short conversation: 16 + 8 + 2 tokens, 2 blocks of 16
    "--conversations=1",
    "--turns=1",
    "--system-tokens=16",
    "--document-tokens=0",
    "--user-tokens=8",
    "--answer-tokens=2",
    "--gpu-blocks=8",
    "--cpu-mib=1",
    "--disk-mib=1",
    "--cascade-cpu-mib=1",
]


def save_tiny_checkpoint(path: Path, config: dict[str, object] = TINY_HF_CONFIG) -> Path:
    """Write ModelConfig.tiny() with random weights as a one-file HF checkpoint at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(ModelConfig.tiny(), seed=3)
    tensors = {
        name if name == "lm_head.weight" else f"model.{name}": p.detach().clone()
        for name, p in model.named_parameters()
    }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def with_defaults(defaults: list[str], options: tuple[str, ...]) -> list[str]:
    """Return `options` after each of `defaults` whose option they do not give.

    A demo option given twice is a usage error, so a caller's value replaces the default
    instead of following it.
    """
    given = {option.split("=", 1)[0] for option in options}
    return [d for d in defaults if d.split("=", 1)[0] not in given] + list(options)


def run_demo(tmp_path: Path, *options: str) -> int:
    """Run `kvtier demo` on the small run with its disk tier and plot under `tmp_path`.

    `options` (each `--name=value`) replace the small run's values and the paths.
    """
    paths = [f"--disk-dir={tmp_path}", f"--out={tmp_path / 'out'}"]
    return main(["demo", *with_defaults([*SMALL_RUN, *paths], options)])


def test_demo_serves_a_checkpoint_with_a_small_vocab(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: prompt ids were drawn below 1000 whatever the checkpoint's vocab.
    model_dir = save_tiny_checkpoint(tmp_path / "ckpt")
    status = run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache")
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "identical tokens across configurations: yes" in captured.out


def test_a_plot_that_cannot_be_written_ends_the_demo_with_one_line_and_keeps_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a full disk ended the demo in an OSError traceback after every run,
    # without the verdict on the tokens.
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    model_dir = save_tiny_checkpoint(tmp_path / "ckpt")  # serves in about a second
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 1
    captured = capsys.readouterr()
    plot = tmp_path / "out" / "demo_ttft.png"
    assert captured.err == (
        f"kvtier demo: error: cannot write the plot {plot}: No space left on device\n"
    )
    assert "CPU+disk" in captured.out
    assert "plotted to" not in captured.out
    assert captured.out.endswith("identical tokens across configurations: yes\n")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _with_config(model_dir: Path, **changes: object) -> None:
    """Save the tiny checkpoint, then rewrite its config.json with `changes` (None drops)."""
    save_tiny_checkpoint(model_dir)
    config = {**TINY_HF_CONFIG, **changes}
    _write(model_dir / "config.json", json.dumps({k: v for k, v in config.items() if v}))


BAD_MODEL_DIRS = {  # case -> (how to make the directory, what the error says)
    "missing": (lambda d: None, "does not exist"),
    "a file": (lambda d: _write(d, "not a checkpoint"), "is not a directory"),
    "no weights": (
        lambda d: _write(d / "config.json", json.dumps(TINY_HF_CONFIG)),
        "no *.safetensors files in",
    ),
    "no config": (
        lambda d: (save_tiny_checkpoint(d) / "config.json").unlink(),
        "No such file or directory",
    ),
    "config not JSON": (
        lambda d: (save_tiny_checkpoint(d), _write(d / "config.json", "{vocab_size: 128")),
        "config.json is not valid JSON",
    ),
    "config lacks a key": (
        lambda d: _with_config(d, hidden_size=None),
        "config.json lacks the key 'hidden_size'",
    ),
    "architecture": (
        lambda d: _with_config(d, architectures=["GPT2LMHeadModel"]),
        'architectures=["GPT2LMHeadModel"] not supported',
    ),
    "weights of another shape": (
        lambda d: _with_config(d, hidden_size=32),
        "has shape (128, 64), the model expects (128, 32)",
    ),
    "weights not safetensors": (
        lambda d: (save_tiny_checkpoint(d) / "model.safetensors").write_bytes(bytes(64)),
        "model.safetensors is not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MODEL_DIRS))
def test_demo_names_a_bad_model_dir(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: only ValueError was caught; a missing directory gave a traceback.
    model_dir = tmp_path / "ckpt"
    make, message = BAD_MODEL_DIRS[case]
    make(model_dir)
    assert run_demo(tmp_path, f"--model-dir={model_dir}") == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvtier demo: error: --model-dir={model_dir}")
    assert message in captured.err
    assert "serving" not in captured.out


@pytest.mark.parametrize("max_position", [20, 25])
def test_demo_names_a_last_turn_beyond_max_position_before_serving(
    max_position: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: the engine refused the prompt in the warm-up (or in a later turn, after
    # minutes of serving) with a ValueError traceback. 25: the last turn's 26 tokens
    # compute 25 positions, which the check let through, but the engine stops a request
    # at max_position tokens (as vLLM): its last answer would be cut short.
    model_dir = tmp_path / "ckpt"
    _with_config(model_dir, max_position_embeddings=max_position)
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "kvtier demo: error: a conversation's last turn holds 26 tokens, more than"
        f" the model's max_position={max_position}: use fewer --turns or shorter messages\n"
    )
    assert "serving" not in captured.out


def test_demo_serves_a_last_turn_that_exactly_fills_max_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a mutation run (s29): refusing a last turn of exactly max_position tokens
    (`>=` for `>`) passed every test; the engine serves it whole."""
    model_dir = tmp_path / "ckpt"
    _with_config(model_dir, max_position_embeddings=26)  # the last turn's 26 tokens
    assert run_demo(tmp_path, f"--model-dir={model_dir}", "--disk-io=page_cache") == 0
    assert capsys.readouterr().err == ""


def test_the_demo_model_s_own_errors_do_not_name_model_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a mutation run (s29): an error building the demo's own model (no
    --model-dir given) was passed on as "--model-dir=ModelConfig(...): ..." once the
    re-raise for a ModelConfig was dropped, with every test passing."""

    def refusing(*args: object, **kwargs: object) -> None:
        raise ValueError("the engine refuses")

    monkeypatch.setattr(demo, "LLM", refusing)
    with pytest.raises(ValueError) as refused:
        demo._load_engine(ModelConfig.demo(), demo.EngineConfig(block_size=16, num_gpu_blocks=8))
    assert str(refused.value) == "the engine refuses"
    with pytest.raises(ValueError) as refused:
        demo._load_engine("/ckpt", demo.EngineConfig(block_size=16, num_gpu_blocks=8))
    assert str(refused.value) == "--model-dir=/ckpt: the engine refuses"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--disk-dir={tmp}/missing", "--disk-dir={tmp}/missing does not exist"),
        ("--disk-dir={tmp}/afile", "--disk-dir={tmp}/afile is a file, not a directory"),
        ("--out={tmp}/afile", "--out={tmp}/afile is a file, not a directory"),
        # Regression (review): any existing non-folder was called 'a file'.
        ("--out=/dev/null", "--out=/dev/null is a character device, not a directory"),
        (
            "--out={tmp}/afile/plots",
            "--out={tmp}/afile/plots cannot be created: {tmp}/afile is not a directory",
        ),
        # Regression (review): root passes `os.access` here; a traceback, or exit 1 after
        # every run for --out.
        ("--disk-dir=/proc", "--disk-dir=/proc: cannot create files in /proc"),
        ("--out=/proc/plots", "--out=/proc/plots: cannot create files in /proc"),
    ],
)
def test_demo_names_a_bad_path_before_serving(
    option: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: a traceback, or for --out exit 1 after every run with no verdict.
    _write(tmp_path / "afile", "")
    assert run_demo(tmp_path, option.format(tmp=tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvtier demo: error: {message.format(tmp=tmp_path)}")
    assert "serving" not in captured.out


def test_demo_refuses_out_dash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review): `--out -` served every run and plotted into a new folder
    named '-', while `-` means stdout to kvtier replay and generate."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_demo(tmp_path, "--out=-")
    assert exit_info.value.code == 2
    assert "--out: - would be stdout, but the demo writes its plot" in capsys.readouterr().err
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("option", ["--out", "--disk-dir", "--model-dir"])
def test_demo_refuses_an_empty_path(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: `--out "$UNSET"` served every run and plotted into the current folder,
    # `--disk-dir ""` put the disk tier there.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_demo(tmp_path, f"{option}=")
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert f"error: argument {option}: expected a path, got an empty string\n" in captured.err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_ends_the_demo_with_one_line_and_removes_its_disk_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: Ctrl-C printed a KeyboardInterrupt traceback.
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_chat", interrupt)  # Ctrl-C in the warm-up
    try:
        status = run_demo(tmp_path)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped: the user sees a traceback")
    assert status == 130
    assert capsys.readouterr().err == "\nkvtier demo: interrupted\n"
    assert list(tmp_path.glob("kvtier-demo-*")) == []


def test_demo_names_disk_io_for_unaligned_blocks_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: the error came when the disk run started, naming DiskIOMode.PAGE_CACHE.
    # The demo model holds 6 KiB of K/V per token: blocks of 1 token are not 4096-aligned.
    assert run_demo(tmp_path, "--block-size=1", "--gpu-blocks=64") == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvtier demo: error: --disk-io=direct writes whole 4096")
    assert "--block-size=1 gives blocks of 6144 bytes: use --disk-io page_cache" in captured.err
    assert "a --block-size that is a multiple of 2" in captured.err
    assert "serving" not in captured.out


@pytest.mark.parametrize(
    ("block_size", "mode", "is_accepted"),
    [
        (16, DiskIOMode.DIRECT, True),  # 8192 bytes
        (8, DiskIOMode.DIRECT, True),  # 4096 bytes
        (4, DiskIOMode.DIRECT, False),  # 2048 bytes
        (4, DiskIOMode.PAGE_CACHE, True),
    ],
)
def test_check_sizes_needs_4096_byte_blocks_for_direct_io(
    block_size: int, mode: DiskIOMode, is_accepted: bool, tmp_path: Path
) -> None:
    workload = ChatWorkload(num_conversations=1, num_turns=1, num_answer_tokens=1)
    layout = KVLayout.single(block_size, 512 * block_size)  # ModelConfig.tiny(): 512 B/token
    disk = OffloadConfig(disk_bytes=1 << 20, disk_path=str(tmp_path), disk_io_mode=mode)
    configs: list[tuple[str, OffloadConfig | None]] = [("offload off", None), ("disk tier", disk)]
    if is_accepted:
        check_sizes(workload, configs, layout, gpu_blocks=1024)
    else:
        with pytest.raises(ValueError, match="a --block-size that is a multiple of 8"):
            check_sizes(workload, configs, layout, gpu_blocks=1024)


@pytest.mark.parametrize(
    ("num_groups", "user_tokens", "told"),
    [
        (1, 16, "17 tokens (2 blocks of 16), more than --gpu-blocks=2 can hold (1 usable block)"),
        (2, 1, "2 tokens (1 block of 16 x 2 KV groups), more than --gpu-blocks=2 can hold"),
    ],
)
def test_a_last_turn_too_long_for_the_gpu_pool_counts_one_in_the_singular(
    num_groups: int, user_tokens: int, told: str
) -> None:
    """Regression (a fresh-user walkthrough): `kvtier demo --gpu-blocks 2` said "(1 usable
    blocks)"; with two KV groups a short turn was "(1 blocks of 16 x 2 KV groups)"."""
    workload = ChatWorkload(
        num_conversations=1,
        num_turns=1,
        num_system_tokens=0,
        num_document_tokens=0,
        num_user_tokens=user_tokens,
        num_answer_tokens=1,
    )
    layout = KVLayout((KVGroupSpec(GroupKind.FULL_ATTENTION, 16, 8192),) * num_groups)
    with pytest.raises(ValueError) as refused:
        check_sizes(workload, [("offload off", None)], layout, gpu_blocks=2)
    assert told in str(refused.value)
