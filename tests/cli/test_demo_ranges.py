"""`kvtier demo` refuses an option out of range before it imports the engine.

Regression: `kvtier demo --turns 0` imported torch and the engine first (about 3.5 s on
2 cores) and only then said "--turns must be >= 1".
"""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from test_demo_options import demo_parser

from kvtier.cli.demo_ranges import check_dependencies, check_dirs, check_options
from kvtier.cli.main import main

REFUSED_WITHOUT_TORCH = """
import sys
from kvtier.cli.main import main
status = main(["demo", *{options!r}])
print(status, sorted({{"torch", "kvtier.engine"}} & set(sys.modules)))
"""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--turns", "0"], "--turns must be >= 1, got 0"),
        (["--gpu-blocks", "-5"], "--gpu-blocks must be >= 2, got -5"),
        (["--conversations", "5000", "--turns", "3"], "the demo serves at most 10000"),
        (["--cascade-cpu-mib", "64", "--disk-mib", "32"], "--cascade-cpu-mib=64 is larger"),
        # Folders too (regression, review: refused only after the import)
        (["--disk-dir", "/nonexistent-kvtier"], "--disk-dir=/nonexistent-kvtier does not exist"),
        (["--out", "/proc/plots"], "--out=/proc/plots: cannot create files in /proc"),
        (["--model-dir", "/nonexistent-kvtier"], "--model-dir=/nonexistent-kvtier does not"),
    ],
)
def test_an_option_out_of_range_is_refused_before_the_engine_is_imported(
    options: list[str], message: str
) -> None:
    code = REFUSED_WITHOUT_TORCH.format(options=options)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 []\n", done.stderr
    assert done.stderr.startswith("kvtier demo: error: ")
    assert message in done.stderr


def test_a_folder_where_the_plot_goes_is_refused_before_the_engine_is_imported(
    tmp_path: Path,
) -> None:
    """Regression: `--out D` with a folder D/demo_ttft.png passed the checks; the demo
    served every configuration (two minutes by default) and then could not write its
    plot ("Is a directory"), ending with status 1."""
    (tmp_path / "demo_ttft.png").mkdir()
    code = REFUSED_WITHOUT_TORCH.format(
        options=["--out", str(tmp_path), "--conversations", "1", "--turns", "1"]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 []\n", done.stderr
    assert done.stderr == (
        f"kvtier demo: error: --out={tmp_path}: {tmp_path / 'demo_ttft.png'} is a directory;"
        " the demo writes its plot there\n"
    )


def test_a_missing_optional_dependency_is_refused_before_the_demo_runs() -> None:
    """Regression: without matplotlib (the `engine` extra) the demo served every
    configuration and then ended in a ModuleNotFoundError traceback, drawing its plot."""
    code = "import sys\nsys.modules['matplotlib'] = None  # `import matplotlib` fails\n"
    code += REFUSED_WITHOUT_TORCH.format(options=["--conversations", "1", "--turns", "1"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 []\n", done.stderr
    assert done.stderr.startswith("kvtier demo: error: the demo needs matplotlib (")
    assert "cannot be imported: pip install 'kvtier[engine]'" in done.stderr


def test_a_broken_optional_dependency_is_refused_before_the_demo_runs(tmp_path: Path) -> None:
    """Regression (review): the check only looked the module up, so a matplotlib that is
    installed but fails to import passed it, and the demo failed after serving."""
    broken = tmp_path / "matplotlib"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a broken matplotlib')\n")
    code = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
    code += "sys.modules['torch'] = None  # the old code would go on to import it\n"
    code += REFUSED_WITHOUT_TORCH.format(options=["--conversations", "1", "--turns", "1"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 ['torch']\n", done.stderr  # torch only as blocked above
    assert "the demo needs matplotlib (a broken matplotlib), which cannot" in done.stderr


def test_a_missing_torch_is_refused_naming_it_without_a_traceback() -> None:
    """Regression: `pip install "kvtier[engine]"` without torch (it is not a dependency:
    the README has the user install the build they want first), and `kvtier demo` ended
    in a ModuleNotFoundError traceback from deep in the engine's imports."""
    code = "import sys\nsys.modules['torch'] = None  # `import torch` fails: not installed\n"
    code += REFUSED_WITHOUT_TORCH.format(options=["--conversations", "1", "--turns", "1"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("2 "), done.stderr
    assert done.stderr == (
        "kvtier demo: error: the demo needs torch: install the torch build you want first, "
        "e.g. the CPU one: pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
    )


def test_a_missing_module_other_than_torch_is_not_called_a_missing_torch() -> None:
    """A broken install (here rich.progress, imported with the demo) keeps its traceback,
    which names the module: only a missing torch gets the install hint. Found by a
    mutation run (s32): a hint for any missing module passed every test."""
    code = "import sys\nsys.modules['rich.progress'] = None  # a broken install\n"
    code += REFUSED_WITHOUT_TORCH.format(options=["--conversations", "1", "--turns", "1"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout
    assert "ModuleNotFoundError: import of rich.progress halted" in done.stderr
    assert "the demo needs torch" not in done.stderr


NO_DIRECT_IO = """
import errno, os
_open = os.open
def _refusing_direct_io(path, flags, *args, **kwargs):  # a filesystem without O_DIRECT
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, "Invalid argument", path)
    return _open(path, flags, *args, **kwargs)
os.open = _refusing_direct_io
"""


def test_a_disk_dir_without_direct_io_is_refused_before_serving(tmp_path: Path) -> None:
    """Regression: on a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, the
    default temp dir on some distributions) `--disk-io direct`, the default, was found
    out only when the disk tier run started, after the offload-off and CPU runs had been
    served (over a minute by default); the message then named the config key
    disk_io_mode, not the demo's --disk-io, and the status was 1."""
    code = NO_DIRECT_IO + REFUSED_WITHOUT_TORCH.format(
        options=["--disk-dir", str(tmp_path), "--conversations", "1", "--turns", "1"]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 []\n", done.stderr
    assert done.stderr == (
        f"kvtier demo: error: --disk-io=direct: the filesystem of --disk-dir={tmp_path} "
        "refused O_DIRECT (it has no direct I/O, e.g. tmpfs before Linux 6.6): use "
        "--disk-io page_cache, or a --disk-dir on a block device\n"
    )
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("option", ["--disk-dir", "--model-dir"])
def test_a_folder_under_a_file_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """Regression (s25 fresh-user review): `--disk-dir afile/sub` said only "does not
    exist", not that `afile` is a file."""
    (tmp_path / "afile").write_text("x")
    folder = tmp_path / "afile" / "sub"
    assert main(["demo", option, str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier demo: error: {option}={folder} does not exist: ")
    assert f"does not exist: {tmp_path / 'afile'} is a file, not a directory" in err


def test_a_missing_folder_under_a_folder_is_only_said_to_be_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "missing" / "sub"
    assert main(["demo", "--disk-dir", str(folder)]) == 2
    assert capsys.readouterr().err.endswith(f"error: --disk-dir={folder} does not exist\n")


@pytest.mark.parametrize("option", ["--disk-dir", "--out", "--model-dir"])
def test_a_folder_name_too_long_for_the_system_is_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """Regression (s34): a 300-byte folder name (ENAMETOOLONG) ended the demo with a
    traceback from `Path.exists` ("OSError: [Errno 36] File name too long")."""
    folder = tmp_path / ("d" * 300)
    assert main(["demo", option, str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier demo: error: {option}={folder}: the name dddddddddddddddd...")
    assert err.endswith("is 300 bytes long, more than the 255 a file name can have here\n")


# The least value of each numeric option, as `kvtier demo --help` states it.
LEAST_VALUES = {
    "--conversations": 1,
    "--turns": 1,
    "--system-tokens": 0,
    "--document-tokens": 0,
    "--user-tokens": 0,
    "--answer-tokens": 1,
    "--gpu-blocks": 2,
    "--block-size": 1,
    "--cpu-mib": 1,
    "--disk-mib": 1,
    "--cascade-cpu-mib": 1,
}


@pytest.mark.parametrize(("option", "least"), LEAST_VALUES.items())
def test_each_number_is_refused_just_below_its_least_value_and_taken_at_it(
    option: str, least: int
) -> None:
    """Found by a mutation run (s29): `--conversations 0`, `--answer-tokens 0`, `--disk-mib
    0` or `--cascade-cpu-mib 0` passed the range check unnoticed by any test (the first two
    then failed after the engine loaded, naming num_conversations, not the option)."""
    with pytest.raises(ValueError) as refused:
        check_options(demo_parser().parse_args([option, str(least - 1)]))
    assert str(refused.value) == f"{option} must be >= {least}, got {least - 1}"
    cascade = [] if option == "--cascade-cpu-mib" else ["--cascade-cpu-mib", "1"]
    check_options(demo_parser().parse_args([option, str(least), *cascade]))  # no error


@pytest.mark.parametrize("given", ["--system-tokens", "--document-tokens", "--user-tokens"])
def test_a_first_prompt_of_one_kind_of_message_alone_is_taken(given: str) -> None:
    """Only all three message lengths at 0 leave the first prompt empty. Found by a mutation
    run (s32): a check that left out --user-tokens (refusing `--system-tokens 0
    --document-tokens 0 --user-tokens 64`) passed every test."""
    zeros = [f"{o}=0" for o in ("--system-tokens", "--document-tokens", "--user-tokens")]
    options = [o for o in zeros if not o.startswith(given)] + [f"{given}=1"]
    check_options(demo_parser().parse_args(options))  # no error


def test_write_back_takes_a_cascade_cpu_tier_larger_than_the_disk() -> None:
    """Only write_through needs the disk to hold every CPU block. Found by a mutation run
    (s32): the check could refuse `--cascade write_back --cascade-cpu-mib 64 --disk-mib 32`
    with every test passing."""
    options = ["--cascade", "write_back", "--cascade-cpu-mib", "64", "--disk-mib", "32"]
    check_options(demo_parser().parse_args(options))  # no error


def test_the_most_turns_are_taken_and_one_more_conversation_is_refused() -> None:
    check_options(demo_parser().parse_args(["--conversations", "100", "--turns", "100"]))
    args = demo_parser().parse_args(["--conversations", "101", "--turns", "100"])
    with pytest.raises(ValueError, match="is 10100 turns; the demo serves at most 10000"):
        check_options(args)


def test_the_temp_dir_without_direct_io_is_refused_when_no_disk_dir_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a mutation run (s29): only a --disk-dir was probed by a test; the default,
    a folder in the temp dir (tmpfs on some distributions), was not."""
    real_open = os.open

    def refusing_direct_io(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.chdir(tmp_path)  # --out: ./out
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(os, "open", refusing_direct_io)
    assert main(["demo", "--conversations", "1", "--turns", "1"]) == 2
    assert capsys.readouterr().err == (
        f"kvtier demo: error: --disk-io=direct: the filesystem of the temp dir {tmp_path / 'tmp'}"
        " refused O_DIRECT (it has no direct I/O, e.g. tmpfs before Linux 6.6): use --disk-io"
        " page_cache, or a --disk-dir on a block device\n"
    )
    assert list((tmp_path / "tmp").iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("error", [errno.EACCES, errno.EPERM, errno.EIO])
def test_an_o_direct_open_failing_otherwise_is_left_to_the_run(
    error: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only EINVAL says the filesystem has no direct I/O; another failure of the probe's
    open is not reported as one (the run names it). Found by a mutation run (s32): a probe
    that took every OSError for "refused O_DIRECT" passed every test."""
    real_open = os.open

    def failing_direct_io(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(error, os.strerror(error), path)
        return real_open(path, flags, *args, **kwargs)

    (tmp_path / "tier").mkdir()
    monkeypatch.setattr(os, "open", failing_direct_io)
    options = ["--disk-dir", str(tmp_path / "tier"), "--out", str(tmp_path / "out")]
    check_dirs(demo_parser().parse_args(options))  # no error
    assert list((tmp_path / "tier").iterdir()) == []  # the probe file is gone


def test_a_dependency_failing_with_any_error_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a mutation run (s29): only an ImportError was tested; a broken install can
    raise anything while it imports (a RuntimeError from a backend, an AttributeError)."""
    real_import = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name == "matplotlib":
            raise RuntimeError("a broken backend")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(ValueError) as refused:
        check_dependencies()
    assert str(refused.value) == (
        "the demo needs matplotlib (a broken backend), which cannot be imported: "
        "pip install 'kvtier[engine]'"
    )
