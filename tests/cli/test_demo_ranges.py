"""`kvtier demo` refuses an option out of range before it imports the engine.

Regression: `kvtier demo --turns 0` imported torch and the engine first (about 3.5 s on
2 cores) and only then said "--turns must be >= 1".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
