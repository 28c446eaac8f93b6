"""`kvtier demo` refuses an option out of range before it imports the engine.

Regression: `kvtier demo --turns 0` imported torch and the engine first (about 3.5 s on
2 cores) and only then said "--turns must be >= 1".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    assert done.stdout == "2 ['torch']\n", done.stderr  # torch only as blocked above
    assert done.stderr.startswith("kvtier demo: error: the demo needs torch, which is not ")
    assert "pip install torch" in done.stderr
    assert "Traceback" not in done.stderr
