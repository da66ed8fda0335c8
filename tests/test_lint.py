"""Undefined names, unused imports and syntax errors are bugs a test run must catch (pyflakes rules via ruff;
the CLI's lazy imports mean a NameError would otherwise surface only on the code path a user hits)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyflakes_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in the [test] extra)")
    r = subprocess.run(
        [ruff, "check", "--select", "F,E9", "--output-format", "concise", "qtool", "scripts", "benchmarks", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
