"""Output paths of `kvtier replay` and `kvtier generate`, checked before the run and
named as typed.

Regressions: `--sweep --out new/sub --json new/r.json` was refused ("no such directory
new") though the sweep creates `new`; `--json` naming a folder the sweep creates
(`--out new --json new`) was accepted, and failed after the whole run; a path ending in
`/` was read without it, so `--json d/` was named `d`, `--json new/` wrote a file
`new`, and `kvtier generate t.jsonl/` replaced the file t.jsonl.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.cli.main import main as kvtier_main
from kvtier.replay import cli as replay_cli
from kvtier.replay.cli import main
from kvtier.replay.trace import write_trace


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "doc.jsonl"
    write_trace(path, doc_trace(seed=5, num_requests=40))
    return path


def replay(tmp_path: Path, *options: str) -> int:
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--quiet", "--capacity", "80"]
    return main([*argv, *options])


def test_a_json_file_in_a_parent_the_sweep_creates_is_written(tmp_path: Path) -> None:
    out = tmp_path / "new" / "sub"
    json_path = tmp_path / "new" / "r.json"
    assert replay(tmp_path, "--sweep", "--out", str(out), "--json", str(json_path)) == 0
    assert json.loads(json_path.read_text())["points"]
    assert (out / "sweep.csv").exists()


def test_a_json_path_through_a_folder_no_one_creates_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: `--sweep --out new --json new/a/../r.json` wrote new/r.json, though
    new/a is never made (a shell refuses `> new/a/../r.json`, and so does --json
    without the sweep). Through a folder the sweep makes, it is written."""
    out, typed = f"{tmp_path}/new", f"{tmp_path}/new/a/../r.json"
    assert replay(tmp_path, "--sweep", "--out", out, "--json", typed) == 2
    assert f"--json {typed}: no such directory {tmp_path}/new/a/.." in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert replay(tmp_path, "--sweep", "--out", f"{out}/a", "--json", typed) == 0
    assert json.loads((tmp_path / "new" / "r.json").read_text())["points"]


def test_a_failed_json_write_removes_the_folders_the_sweep_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "r.json")

    monkeypatch.setattr(replay_cli, "write_json", full_disk)  # after the CSV and plot
    out, json_path = f"{tmp_path}/new/sub", f"{tmp_path}/new/r.json"
    assert replay(tmp_path, "--sweep", "--out", out, "--json", json_path) == 1
    assert "writing the results failed: [Errno 28] No space left" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.jsonl"]


@pytest.mark.parametrize("json_path", ["new", "new/", "new/sub", "new/sub/."])
def test_a_folder_the_sweep_creates_is_refused_as_the_json_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], json_path: str
) -> None:
    out = f"{tmp_path}/new/sub"
    typed = f"{tmp_path}/{json_path}"
    assert replay(tmp_path, "--sweep", "--out", out, "--json", typed) == 2
    stdout, err = capsys.readouterr()
    assert stdout == ""
    assert f"--json {typed}: is a folder that --out {out} creates; give a file name" in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("typed", "error"),
    [
        ("folder/", "is a directory, give a file name"),
        ("folder/.", "is a directory, give a file name"),
        ("new/", "names a directory, give a file name"),
        ("new/..", "names a directory, give a file name"),
        # Regression: these said "names a directory", of a path naming a file.
        ("doc.jsonl/", "ends in / but {tmp}/doc.jsonl is a file"),
        ("doc.jsonl//", "ends in / but {tmp}/doc.jsonl is a file"),
        ("doc.jsonl/.", "ends in /. but {tmp}/doc.jsonl is a file"),
    ],
)
def test_a_json_path_naming_a_folder_is_refused_as_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], typed: str, error: str
) -> None:
    (tmp_path / "folder").mkdir()
    path = f"{tmp_path}/{typed}"
    assert replay(tmp_path, "--json", path) == 2
    stdout, err = capsys.readouterr()
    assert stdout == ""
    assert err == f"kvtier replay: error: --json {path}: {error.format(tmp=tmp_path)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.jsonl", "folder"]


def test_an_out_folder_that_is_a_file_is_named_as_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = f"{tmp_path}/doc.jsonl/"
    assert replay(tmp_path, "--sweep", "--out", path) == 2
    assert f"--out {path}: is not a directory (it is a file)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "kind"), [(None, "a character device"), (os.mkfifo, "a named pipe")]
)
def test_an_out_folder_that_is_a_device_or_a_pipe_says_what_it_is(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[str], None] | None,
    kind: str,
) -> None:
    """Regression: /dev/null and a named pipe were called "a file"."""
    path = os.devnull
    if make is not None:
        path = str(tmp_path / "pipe")
        make(path)
    assert replay(tmp_path, "--sweep", "--out", path) == 2
    assert f"--out {path}: is not a directory (it is {kind})\n" in capsys.readouterr().err


def test_out_dash_is_refused_as_a_sweep_cannot_go_to_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `--out -` made a folder named `-`, where `--json -` writes to stdout."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        replay(tmp_path, "--sweep", "--out", "-")
    assert exit_info.value.code == 2
    assert "error: argument --out: - would be stdout, but --sweep writes two files" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "-").exists()
    assert replay(tmp_path, "--sweep", "--out", "./-") == 0  # a folder named -, as typed
    assert sorted(p.name for p in (tmp_path / "-").iterdir()) == ["sweep.csv", "sweep.png"]


def test_the_default_out_is_named_as_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: without --out the errors read `--out replay_out ...`, an option the user
    never typed."""
    monkeypatch.chdir(tmp_path)
    assert replay(tmp_path, "--sweep", "--json", "replay_out") == 2
    error = "--json replay_out: is a folder that the default --out replay_out creates"
    assert error in capsys.readouterr().err
    (tmp_path / "replay_out").write_text("")
    assert replay(tmp_path, "--sweep") == 2
    error = "error: the default --out replay_out: is not a directory (it is a file)\n"
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("typed", ["dangling", "dangling/sub"])
def test_an_out_folder_through_a_dangling_link_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], typed: str
) -> None:
    """Regression: a symbolic link to nothing passed the checks (it does not "exist"),
    and mkdir failed on it after the whole sweep ("File exists", status 1)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    path = f"{tmp_path}/{typed}"
    assert replay(tmp_path, "--sweep", "--out", path) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"kvtier replay: error: --out {path}: cannot create it, {tmp_path}/dangling is a "
        f"symbolic link to {tmp_path}/nowhere, which does not exist\n"
    )


@pytest.mark.parametrize("typed", ["a", "a/sub"])
def test_an_out_folder_through_a_loop_of_links_is_named_a_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], typed: str
) -> None:
    """Regression: with a -> b -> a, `--out a` said a links to b "which does not exist"."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    path = f"{tmp_path}/{typed}"
    assert replay(tmp_path, "--sweep", "--out", path) == 2
    assert capsys.readouterr().err == (
        f"kvtier replay: error: --out {path}: cannot create it, {tmp_path}/a is a symbolic "
        f"link to {tmp_path}/b, a loop of symbolic links\n"
    )


def test_the_json_written_is_named_as_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert replay(tmp_path, "--json", "./r.json") == 0
    assert capsys.readouterr().out.endswith("\nwrote ./r.json\n")
    assert json.loads((tmp_path / "r.json").read_text())["points"]


def test_written_paths_starting_with_a_dash_are_shown_pasteable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `--sweep --out ./-` showed "wrote -/sweep.csv", which a command given
    it reads as an option; so did `--json=-r.json` and `generate -- -t.jsonl`."""
    monkeypatch.chdir(tmp_path)
    assert replay(tmp_path, "--sweep", "--out", "./-", "--json=-r.json") == 0
    lines = capsys.readouterr().out.splitlines()[-3:]
    assert lines == ["wrote ./-/sweep.csv", "wrote ./-/sweep.png", "wrote ./-r.json"]
    assert kvtier_main(["generate", "--conversations", "2", "--", "-t.jsonl"]) == 0
    assert capsys.readouterr().out.endswith(" requests to ./-t.jsonl\n")
    assert (tmp_path / "-t.jsonl").exists()


@pytest.mark.parametrize("typed", ["chat.jsonl/", "new.jsonl/"])
def test_generate_refuses_a_path_naming_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], typed: str
) -> None:
    before = tmp_path / "chat.jsonl"
    before.write_text("kept\n")
    path = f"{tmp_path}/{typed}"
    with pytest.raises(SystemExit) as exit_info:
        kvtier_main(["generate", path, "--conversations", "2"])
    assert exit_info.value.code == 2
    error = f"kvtier generate: error: out {path}: names a directory, give a file name"
    if typed == "chat.jsonl/":  # regression: it said "names a directory" of the file
        error = f"kvtier generate: error: out {path}: ends in / but {before} is a file"
    assert error in capsys.readouterr().err
    assert before.read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]
