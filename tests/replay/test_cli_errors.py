"""`kvtier replay` reports mistakes before the run, naming what is wrong; it survives huge
capacities and a reader that closes the pipe."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay.cli import EXIT_BROKEN_PIPE, main, parse_tokens
from kvtier.replay.option_types import policy_name
from kvtier.replay.trace import write_trace


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "doc.jsonl"
    write_trace(path, doc_trace(seed=5, num_requests=40))
    return path


def replay(tmp_path: Path, *options: str) -> int:
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--quiet", *options]
    return main(argv)


def assert_error_before_the_run(capsys: pytest.CaptureFixture[str], *parts: str) -> None:
    out, err = capsys.readouterr()
    assert out == "", "the error must come before the run prints anything"
    assert err.startswith("kvtier replay: error: ")
    for part in parts:
        assert part in err


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        (["--json", "{tmp}/missing/r.json"], ["--json", "missing/r.json", "no such directory"]),
        (["--json", "{tmp}"], ["--json", "is a directory"]),
        (["--json", "{tmp}/loop.json"], ["--json", "loop.json: a loop of symbolic links"]),
        (["--json", "{tmp}/doc.jsonl/r.json"], ["--json", "doc.jsonl is not a directory"]),
        (["--sweep", "--out", "{tmp}/doc.jsonl"], ["--out", "doc.jsonl", "not a directory"]),
        (["--sweep", "--out", "{tmp}/doc.jsonl/sub"], ["--out", "doc.jsonl is not a directory"]),
    ],
)
def test_unwritable_output_paths_are_errors_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], parts: list[str]
) -> None:
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    options = [o.format(tmp=tmp_path) for o in options]
    assert replay(tmp_path, "--capacity", "80", *options) == 2
    assert_error_before_the_run(capsys, *parts)


@pytest.mark.parametrize(
    ("name", "options", "parts"),
    [
        ("doc.jsonl", ["--json", "{tmp}/doc.jsonl"], ["--json", "would overwrite the trace"]),
        ("doc.jsonl", ["--json", "{tmp}/link.jsonl"], ["link.jsonl: would overwrite the trace"]),
        (
            "doc.jsonl",
            ["--sweep", "--out", "{tmp}", "--json", "{tmp}/sweep.csv"],
            ["--json", "sweep.csv: would overwrite --out's", "sweep.csv"],
        ),
        ("sweep.png", ["--sweep", "--out", "{tmp}"], ["--out", "png: would overwrite the trace"]),
    ],
)
def test_an_output_that_would_overwrite_the_trace_or_another_output_is_an_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    options: list[str],
    parts: list[str],
) -> None:
    trace = trace_file(tmp_path).rename(tmp_path / name)
    (tmp_path / "link.jsonl").symlink_to(trace)
    original = trace.read_bytes()
    options = [o.format(tmp=tmp_path) for o in options]
    argv = [str(trace), "--block-size", str(BLOCK), "--quiet", "--capacity", "80", *options]
    assert main(argv) == 2
    assert_error_before_the_run(capsys, *parts)
    assert trace.read_bytes() == original
    assert not (tmp_path / "sweep.csv").exists()


@pytest.mark.parametrize("option", ["--json", "--out"])
def test_an_empty_output_path_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """`--json "$UNSET"` wrote no JSON and `--out ""` wrote to the default folder, silently."""
    with pytest.raises(SystemExit) as exit_info:
        replay(tmp_path, "--capacity", "80", "--sweep", option, "")
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a path, got an empty string" in capsys.readouterr().err


def test_json_and_sweep_folder_are_written_when_valid(tmp_path: Path) -> None:
    out = tmp_path / "new" / "folder"
    assert replay(tmp_path, "--capacity", "80", "--sweep", "--out", str(out)) == 0
    assert (out / "sweep.csv").exists()
    assert replay(tmp_path, "--capacity", "80", "--json", str(tmp_path / "r.json")) == 0
    assert json.loads((tmp_path / "r.json").read_text())["points"]
    inside = tmp_path / "results"  # a JSON file in a --out folder the sweep creates
    options = ["--capacity", "80", "--sweep", "--out", str(inside), "--json", f"{inside}/r.json"]
    assert replay(tmp_path, *options) == 0
    assert json.loads((inside / "r.json").read_text())["points"]
    assert (inside / "sweep.csv").exists()


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        (["--out", "somewhere"], ["--out", "--sweep"]),
        (["--disk-link-gbps", "3"], ["--disk-link-gbps", "--disk-capacity"]),
        (["--capacity", "0"], ["--capacity/--cpu 0 holds no 8-token block (--block-size 8)"]),
        (["--capacity", "1M", "--capacity", "7"], ["--capacity/--cpu 7 holds no 8-token"]),
        (["--cpu", "7"], ["--capacity/--cpu 7 holds no 8-token block"]),
        (["--disk-capacity", "7"], ["--disk-capacity/--disk 7 holds no", "or 0 for none"]),
        (["--disk", "7"], ["--disk-capacity/--disk 7 holds no", "or 0 for none"]),
        (["--gpu-capacity", "7"], ["--gpu-capacity 7 holds no", "or 0 for none"]),
        (
            ["--capacity", "64", "--disk", "32", "--cascade", "write_through"],
            ["--disk-capacity 32 is smaller than the CPU capacity 64", "--cascade write_back"],
        ),
        (
            ["--disk", "1M", "--cascade", "write_through", "--sweep", "--out", "x"],
            ["--disk-capacity 1M is smaller than the CPU capacity 30M"],
        ),
    ],
)
def test_options_that_would_be_ignored_or_are_zero_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], parts: list[str]
) -> None:
    assert replay(tmp_path, *options) == 2
    assert_error_before_the_run(capsys, *parts)


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        (
            ["--sweep", "--block-size", "200000", "--out", "{tmp}/sweep"],
            [
                "--block-size 200000: --sweep's default capacities run 100k ... 30M, and 100k "
                "holds no 200000-token block",
                "give --capacity (at least 200000 tokens)",
            ],
        ),
        (
            ["--block-size", "1048576"],
            ["--block-size 1048576: the default --capacity 1M holds no 1048576-token block"],
        ),
    ],
)
def test_a_block_larger_than_a_default_capacity_names_the_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], parts: list[str]
) -> None:
    """It read `tier CPU: capacity 100000 tokens holds no 200000-token block`, no flag."""
    trace = trace_file(tmp_path)
    argv = [str(trace), "--quiet", *(o.format(tmp=tmp_path) for o in options)]
    assert main(argv) == 2
    assert_error_before_the_run(capsys, *parts)
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--block-size", "0", "must be > 0, got 0"),
        # Regression: no cap; the mismatch with the trace was found after reading it all.
        ("--block-size", "1048577", "must be <= 1048576, got 1048577"),
        ("--block-size", "9" * 30, f"must be <= 1048576, got {'9' * 30}"),
        ("--bytes-per-token", "-3", "must be > 0, got -3"),
        ("--bytes-per-token", "1.5", "invalid integer '1.5': use digits 0-9"),
        ("--prefill-tokens-per-s", "inf", "must be >= 1e-06 and finite, got 'inf'"),
        ("--prefill-tokens-per-s", "nan", "must be >= 1e-06 and finite, got 'nan'"),
        ("--cpu-link-gbps", "0", "must be >= 1e-06 and finite, got '0'"),
        # Regression: 1e-320 GB/s wrote "mean_ttft_s": Infinity, which is not JSON.
        ("--cpu-link-gbps", "1e-320", "must be >= 1e-06 and finite, got '1e-320'"),
        ("--prefill-tokens-per-s", "1e-7", "must be >= 1e-06 and finite, got '1e-7'"),
        ("--bytes-per-token", "1073741825", "must be <= 1073741824 (1 GiB), got 1073741825"),
        ("--disk-link-gbps", "abc", "invalid number 'abc': use digits 0-9, e.g. 2.5 or 1e9"),
    ],
)
def test_numbers_out_of_range_are_usage_errors_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    """They were reported by the names of the fields they set (block_size, link_gbps)."""
    with pytest.raises(SystemExit) as exit_info:
        replay(tmp_path, "--disk", "1M", option, value)
    assert exit_info.value.code == 2
    assert f"error: argument {option}: {message}\n" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0.4", "1.5", "1.0000001M"])
def test_fractional_token_counts_are_rejected_naming_the_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}'.*not a whole number"):
        parse_tokens(text)


@pytest.mark.parametrize(
    ("policy", "parts"),
    [
        ("belady+door", ["'belady' is an offline policy", "no admission filter"]),
        # Regression: "such as '+'" (nothing after the '+'), and the bad part lowercased.
        ("belady+", ["'belady' is an offline policy", "no '+' after it; use 'belady'"]),
        ("LRU+Bogus", ["unknown admission policy 'Bogus' in 'LRU+Bogus'; choose one of door"]),
        ("lru+", ["policy 'lru+': missing admission policy after '+'"]),
        ("oracle-lfu+door", ["'oracle-lfu' is an offline policy"]),
        ("foo", ["unknown policy 'foo'", "lru", "door", "belady", "oracle-lfu"]),
    ],
)
def test_policy_errors_say_what_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, parts: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        replay(tmp_path, "--policy", policy)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for part in parts:
        assert part in err


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("lru + door", "lru+door"),
        (" ARC+Door ", "arc+door"),
        ("belady ", "belady"),
        ("LRU", "lru"),
        ("duel", "duel"),
    ],
)
def test_policy_names_are_read_as_the_library_reads_them(text: str, name: str) -> None:
    """Regression: `--policy "lru + door"` was refused, though `PolicySpec.parse` (the
    config's reader) takes it."""
    assert policy_name(text) == name


@pytest.mark.parametrize(
    "outputs", [["--sweep", "--out", "{tmp}/sweep"], ["--json", "{tmp}/r.json"]]
)
def test_belady_asked_for_with_a_cascade_is_an_error_with_sweep_or_json_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outputs: list[str]
) -> None:
    """--sweep and --json drop belady from their reference lines under --cascade; one the
    user asked for was dropped with them, silently, instead of being refused. The error
    names the options typed (it named the config's field: `cascade=write_back`)."""
    options = ["--capacity", "80", "--disk", "160", "--cascade", "write_back"]
    options += ["--policy", "belady", *(o.format(tmp=tmp_path) for o in outputs)]
    assert replay(tmp_path, *options) == 2
    assert_error_before_the_run(
        capsys, "--cascade write_back works with online policies only, not --policy belady"
    )
    assert not (tmp_path / "sweep").exists()
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(("name", "reason"), [("missing.jsonl", "No such file"), ("", "Is a dir")])
def test_a_trace_that_cannot_be_read_is_named_as_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, reason: str
) -> None:
    """It read `[Errno 2] No such file or directory: '...'`, Python's wording."""
    trace = tmp_path / name
    assert main([str(trace), "--quiet", "--json", str(tmp_path / "r.json")]) == 2
    assert_error_before_the_run(capsys, f"error: cannot read the trace {trace}: {reason}")
    assert not (tmp_path / "r.json").exists()


def test_a_block_size_other_than_the_traces_is_named_with_the_one_it_looks_like(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It read as a broken line 1 of the trace, with nothing to say the option is wrong."""
    argv = [str(trace_file(tmp_path)), "--block-size", str(2 * BLOCK), "--quiet"]
    assert main(argv) == 2
    assert_error_before_the_run(
        capsys, f"at block size {2 * BLOCK} (the trace's block size looks like {BLOCK}"
    )


def test_a_request_larger_than_the_gpu_names_its_line_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = doc_trace(seed=5, num_requests=40)
    sizes = [len(r.hash_ids) for r in records]
    line = sizes.index(max(sizes)) + 1
    gpu = (max(sizes) - 1) * BLOCK
    assert replay(tmp_path, "--capacity", "80", "--gpu-capacity", str(gpu)) == 2
    assert_error_before_the_run(
        capsys, f"doc.jsonl:{line}: the request needs {max(sizes)} GPU blocks"
    )


def test_huge_capacities_run_on_what_the_trace_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = "999999999G"
    assert replay(tmp_path, "--capacity", huge, "--gpu-capacity", huge, "--disk", huge) == 0
    assert f" {huge} " in capsys.readouterr().out


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_closed_pipe_ends_quietly_and_keeps_the_files(tmp_path: Path, unbuffered: bool) -> None:
    argv = [sys.executable, "-m", "kvtier.replay", str(trace_file(tmp_path))]
    argv += ["--block-size", str(BLOCK), "--quiet", "--capacity", "80"]
    argv += ["--json", str(tmp_path / "r.json")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:  # every print writes at once: the first one finds the pipe closed
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line (`| head -0`)
    try:
        done = subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr.decode() == ""
    assert done.returncode == EXIT_BROKEN_PIPE
    assert json.loads((tmp_path / "r.json").read_text())["points"]


def test_no_progress_bar_is_drawn_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log file or CI job got hundreds of tqdm redraws; --quiet alone stopped them."""
    argv = [str(trace_file(tmp_path)), "--block-size", str(BLOCK), "--policy", "belady"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""


def test_a_sweep_without_matplotlib_is_an_error_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # matplotlib is optional (kvtier[engine]); it was first imported to draw the plot,
    # after the whole sweep, which ended in a traceback with neither file written.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "sweep_out"
    assert replay(tmp_path, "--capacity", "80", "--sweep", "--out", str(out)) == 2
    assert_error_before_the_run(capsys, "--sweep", "matplotlib", "pip install")
    assert not out.exists()
