"""`kvtier demo` end to end on a small workload: every configuration, identical tokens."""

from __future__ import annotations

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
            "--conversations=2",
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
    assert (tmp_path / "out" / "demo_ttft.png").is_file()
