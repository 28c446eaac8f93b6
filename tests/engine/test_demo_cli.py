"""`kvtier demo` end to end on a small workload: every configuration, identical tokens."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli.main import main


def test_demo_runs_every_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # output to a pipe: no cell truncated
    status = main(
        [
            "demo",
            "--conversations=4",  # their histories leave the 24-block GPU pool
            "--turns=2",
            "--system-tokens=32",
            "--document-tokens=64",
            "--user-tokens=16",
            "--answer-tokens=4",
            "--gpu-blocks=24",
            "--cpu-mib=8",
            "--disk-mib=8",
            "--cascade-cpu-mib=1",
            "--cascade=write_back",
            "--disk-io=page_cache",
            f"--disk-dir={tmp_path}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    for name in ("offload off", "CPU tier", "disk tier", "CPU+disk", "p50 off-GPU", "MiB out"):
        assert name in out
    assert "…" not in out
    assert "identical tokens across configurations: yes" in out
    # Every tier served tokens, so the tokens compared test each of them. Regression
    # (s29 mutation run): with 2 conversations every history stayed on the GPU, no tier
    # served a token, and the verdict compared tokens computed as with offload off.
    assert "served no tokens" not in out
    # SPEC §6.10 Beyond: bytes moved and the achieved bandwidth per direction.
    for direction in ("GPU → CPU", "CPU → GPU", "GPU → DISK", "DISK → GPU", "CPU → DISK"):
        assert direction in out
    assert "MiB/s" in out
    # What the copy time is, under the table: the caption wraps at the table's width,
    # which the measured rates' digits set, so any of its spaces may be a line break.
    assert "queueing excluded" in " ".join(out.split())
    assert (tmp_path / "out" / "demo_ttft.png").is_file()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("--turns=0", "--turns must be >= 1, got 0"),
        ("--cpu-mib=-1", "--cpu-mib must be >= 1, got -1"),
        ("--system-tokens=-3", "--system-tokens must be >= 0, got -3"),
        ("--block-size=0", "--block-size must be >= 1, got 0"),
        # Regression: 10^8 conversations ran silently for minutes, holding 10 GB.
        (
            "--conversations=100000000 --turns=1",
            "--conversations=100000000 x --turns=1 is 100000000 turns; the demo serves at most",
        ),
        (
            "--system-tokens=0 --document-tokens=0 --user-tokens=0",
            "--system-tokens, --document-tokens and --user-tokens are all 0",
        ),
        (
            "--block-size=256 --gpu-blocks=8 --cpu-mib=1",
            "--cpu-mib=1 is too small for the CPU tier run: cpu_bytes=1048576 holds 0 blocks of",
        ),
        # Found by a mutation run (s32): the CPU+disk run's CPU budget could be named
        # --cpu-mib, the option that sizes another run.
        (
            "--block-size=256 --gpu-blocks=8 --cascade-cpu-mib=1",
            "--cascade-cpu-mib=1 is too small for the CPU+disk run: cpu_bytes=1048576 holds 0",
        ),
        (
            "--cascade-cpu-mib=600 --disk-mib=100",
            "--cascade-cpu-mib=600 is larger than --disk-mib=100: with --cascade write_through",
        ),
        # Regression: these two failed with a ConfigError traceback once the "offload
        # off" run had been served, naming cpu_bytes / disk_bytes, not the option.
        (
            "--cpu-mib=100000000",
            "--cpu-mib=100000000 is too large for the CPU tier run: cpu_bytes=104857600000000"
            " exceeds this machine's memory",
        ),
        (
            "--disk-mib=100000000",
            "--disk-mib=100000000 is too large for the disk tier run: the filesystem holding",
        ),
        (
            "--gpu-blocks=1000000000000",
            "--gpu-blocks=1000000000000 blocks of --block-size=16 tokens: the KV cache needs",
        ),
        (  # Regression: "--block-size=1 tokens", "x 1 tokens x" (a count of one is singular).
            "--block-size=1 --gpu-blocks=100000000000000",
            "--gpu-blocks=100000000000000 blocks of --block-size=1 token: the KV cache needs "
            "614400000000000000 bytes (100000000000000 blocks x 1 token x 6144 bytes)",
        ),
        (  # Regression: only --gpu-blocks=96 was named, though the blocks were too large.
            "--block-size=100000",
            "--gpu-blocks=96 blocks of --block-size=100000 tokens: the KV cache needs",
        ),
        (
            "--gpu-blocks=24",
            "last turn holds 848 tokens (53 blocks of 16), more than --gpu-blocks=24 can hold"
            " (23 usable blocks): raise --gpu-blocks to at least 54",
        ),
    ],
)
def test_demo_names_a_bad_option_before_serving(
    options: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    given = {option.split("=", 1)[0] for option in options.split()}
    small = [o for o in ("--conversations=1", "--turns=1") if o.split("=", 1)[0] not in given]
    assert main(["demo", *small, *options.split()]) == 2  # not after: a repeat exits at once
    captured = capsys.readouterr()
    assert captured.err.startswith("kvtier demo: error: ")
    assert message in captured.err
    assert "serving" not in captured.out


def test_demo_runs_when_the_last_turn_exactly_fills_the_gpu_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 32 + 32 + 16 + 16 = 96 tokens = 6 blocks of 16: 7 blocks with the null block.
    status = main(
        [
            "demo",
            "--conversations=1",
            "--turns=1",
            "--system-tokens=32",
            "--document-tokens=32",
            "--user-tokens=16",
            "--answer-tokens=16",
            "--gpu-blocks=7",
            "--cpu-mib=4",
            "--disk-mib=4",
            "--cascade-cpu-mib=1",
            f"--disk-dir={tmp_path}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    assert status == 0, capsys.readouterr().out


def test_demo_help_states_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvtier demo --help` gives the default of every option that has one."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = text.split("options:", 1)[1].split(" --")[1:]
    assert len(options) >= 15
    for option in options:
        name = option.split()[0]
        if name not in ("help", "model-dir", "disk-dir") and "default" not in option:
            raise AssertionError(f"--{name} does not state its default: --{option}")


def test_sigterm_stops_the_demo_and_removes_its_disk_tier_folder(tmp_path: Path) -> None:
    # Regression: `timeout` or `kill` ended the demo on the spot, leaving its folder and
    # the disk tier's preallocated slot file (256 MiB by default) in the temp directory.
    options = ["--conversations=2", "--turns=2", "--system-tokens=32", "--user-tokens=16"]
    options += ["--document-tokens=64", "--answer-tokens=4", "--gpu-blocks=24"]
    options += ["--cpu-mib=8", "--disk-mib=8", "--cascade-cpu-mib=1", "--disk-io=page_cache"]
    options += [f"--disk-dir={tmp_path}", f"--out={tmp_path / 'out'}"]
    command = [sys.executable, "-m", "kvtier.cli.main", "demo", *options]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("kvtier-demo-*/*.slots")):  # the disk tier run
            assert proc.poll() is None, "the demo ended before its disk tier run"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.terminate()
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 143, stderr
    assert "Traceback" not in stderr
    assert list(tmp_path.glob("kvtier-demo-*")) == []
