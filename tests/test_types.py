"""The type checker on the layer pipeline's lower floors and on quantize (qtool/io, qtool/stream,
qtool/ops/quantize: the set and the settings are pyproject's [tool.mypy]): a wrong type there is a bug a test
run must catch, not the first 397B run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_io_stream_and_quantize_type_check():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the [test] extra)")
    # the checkout's qtool, whatever the environment installed; no cache left in the tree
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MYPY_CACHE_DIR": os.devnull}
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
