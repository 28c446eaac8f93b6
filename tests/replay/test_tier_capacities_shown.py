"""`kvtier replay` shows every tier's capacity: the table had one capacity column, the
CPU tier's, so a cascade (CPU + DISK) or a GPU tier in front ran with sizes the output
did not state (found by a fresh-user walkthrough). The JSON and CSV rows carry them too."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.cli import main
from kvtier.replay.trace import write_trace


def replay(tmp_path: Path, *options: str) -> int:
    trace = tmp_path / "doc.jsonl"
    write_trace(trace, doc_trace(seed=5, num_requests=30))
    return main([str(trace), "--block-size", str(BLOCK), "--quiet", *options])


def table(out: str) -> list[dict[str, str]]:
    """The table's rows as {column title: cell} (titles and cells at least 2 spaces apart)."""
    header, _, *rows = out.splitlines()[1:]
    titles = re.split(r"\s{2,}", header)
    return [dict(zip(titles, re.split(r"\s{2,}", row.strip()), strict=False)) for row in rows[:-1]]


@pytest.mark.parametrize(
    "cascade", [[], ["--cascade", "write_back"], ["--cascade", "write_through"]]
)
def test_the_table_shows_the_disk_tiers_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cascade: list[str]
) -> None:
    assert replay(tmp_path, "--cpu", "80", "--cpu", "120", "--disk", "160", *cascade) == 0
    rows = table(capsys.readouterr().out)
    assert [(r["CPU capacity"], r["DISK capacity"]) for r in rows] == [
        ("80", "160"),
        ("120", "160"),
    ]


def test_the_table_shows_the_gpu_tiers_capacity_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay(tmp_path, "--cpu", "80", "--gpu-capacity", "400") == 0
    out = capsys.readouterr().out
    assert re.split(r"\s{2,}", out.splitlines()[1])[:3] == [
        "policy",
        "GPU capacity",
        "CPU capacity",
    ]
    assert [(r["GPU capacity"], r["CPU capacity"]) for r in table(out)] == [("400", "80")]


def test_one_lower_tier_keeps_the_one_capacity_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay(tmp_path, "--cpu", "80") == 0
    assert [r["capacity"] for r in table(capsys.readouterr().out)] == ["80"]


def test_the_json_and_csv_rows_carry_every_tiers_capacity(tmp_path: Path) -> None:
    result, out = tmp_path / "r.json", tmp_path / "out"
    argv = ["--cpu", "80", "--disk", "160", "--gpu-capacity", "400", "--policy", "arc"]
    assert replay(tmp_path, *argv, "--sweep", "--out", str(out), "--json", str(result)) == 0
    with (out / "sweep.csv").open() as file:
        rows = list(csv.DictReader(file))
    points = json.loads(result.read_text())["points"]
    assert len(rows) == len(points) == 3  # arc, lru, belady
    for point, row in zip(points, rows, strict=True):
        sizes = ("capacity_tokens", "gpu", "cpu", "disk")
        keys = [s if s == "capacity_tokens" else f"{s}_capacity_tokens" for s in sizes]
        assert [point[k] for k in keys] == [80, 400, 80, 160]
        assert [int(row[k]) for k in keys] == [80, 400, 80, 160]
