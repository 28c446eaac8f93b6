"""Files `kvtier replay` writes are complete or untouched (traces, sweep CSV/JSON/PNG)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.replay.trace import TraceRecord, read_trace, write_trace
from kvtier.replay.whole_file import whole_file

RECORDS = [TraceRecord(i, 512, 8, (i,)) for i in range(4)]


def failing_after(num_records: int) -> Iterator[TraceRecord]:
    """Yield records, then fail the way a full disk or Ctrl-C would."""
    yield from RECORDS[:num_records]
    raise OSError(28, "No space left on device")


def test_a_trace_write_that_fails_part_way_leaves_the_old_trace(tmp_path: Path) -> None:
    """A half-written trace would replay later as a shorter one, with no error."""
    path = tmp_path / "trace.jsonl"
    write_trace(path, RECORDS)
    with pytest.raises(OSError, match="No space"):
        write_trace(path, failing_after(2))
    assert read_trace(path) == RECORDS
    assert sorted(os.listdir(tmp_path)) == ["trace.jsonl"]  # no temporary file left


def test_a_new_trace_that_fails_part_way_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "new.jsonl"
    with pytest.raises(OSError, match="No space"):
        write_trace(path, failing_after(3))
    assert os.listdir(tmp_path) == []


def test_an_interrupt_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text("old\n", encoding="utf-8")

    def interrupted_write() -> None:
        with whole_file(path) as file:
            file.write("new, half")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_write()
    assert path.read_text(encoding="utf-8") == "old\n"
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_completed_write_keeps_the_mode_a_plain_open_gives(tmp_path: Path) -> None:
    """A new file gets the umask's mode (not mkstemp's 0600); an existing one keeps its own."""
    fresh, existing = tmp_path / "fresh.csv", tmp_path / "existing.csv"
    existing.write_text("x", encoding="utf-8")
    existing.chmod(0o640)
    umask = os.umask(0o022)
    try:
        for path in (fresh, existing):
            with whole_file(path) as file:
                file.write("a,b\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640
    assert existing.read_text(encoding="utf-8") == "a,b\n"


def test_a_symbolic_link_is_followed(tmp_path: Path) -> None:
    """The file the link names gets the content; the link stays a link."""
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("", encoding="utf-8")
    link.symlink_to(real)
    write_trace(link, RECORDS)
    assert link.is_symlink()
    assert read_trace(real) == RECORDS


def test_a_device_is_written_in_place() -> None:
    """`/dev/null` (like `/dev/stdout` or a pipe) cannot be renamed over: written directly."""
    with whole_file("/dev/null", binary=True) as file:
        file.write(b"discarded")
    assert Path("/dev/null").is_char_device()


@pytest.mark.parametrize("path", ["/dev/full", "full.link"])
def test_a_full_device_is_named_in_the_error(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `kvtier replay t.jsonl --json /dev/full` ended with "writing the results
    failed: [Errno 28] No space left on device", naming no file."""
    monkeypatch.chdir(tmp_path)
    Path("full.link").symlink_to("/dev/full")
    with pytest.raises(OSError, match="No space left") as raised, whole_file(path) as file:
        file.write("x" * 100_000)
    assert raised.value.filename == path
    assert path in str(raised.value)
