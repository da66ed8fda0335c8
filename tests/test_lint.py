"""The lint rules of pyproject's [tool.ruff.lint] (pycodestyle, pyflakes, isort, bugbear, pyupgrade, simplify)
hold over the code and its tests: undefined names, unused imports and syntax errors are bugs a test run must
catch (the CLI's lazy imports mean a NameError would otherwise surface only on the code path a user hits), and
the rest keeps the code in one style."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in the [test] extra)")
    r = subprocess.run(
        [ruff, "check", "--output-format", "concise", "qtool", "scripts", "benchmarks", "tests"],  # pyproject's rules
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
