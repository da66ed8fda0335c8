"""A new user's first hour (issue 53): each defect found by trying qtool as a new user, reproduced with the
same command and input it was found with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _installed_qtool(args, *, cwd, timeout=300):
    """`qtool ARGS` as the installed console script runs it: the script's own folder first on sys.path (never
    the current folder), and the package found by the install, not through PYTHONPATH (which would also reach
    the ranks' `sys.path` and hide the shadowing)."""
    boot = (f"import sys\nsys.path[0] = {str(ROOT)!r}\n"
            "from qtool.cli.main import console\nsys.argv = ['qtool', *sys.argv[1:]]\nconsole()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", boot, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_ranks_start_in_a_folder_that_holds_a_qtool_folder(tiny_bf16, tmp_path):
    """Found: `cd DIR && qtool quantize ... --nproc 2` where DIR holds a folder named `qtool` (the parent of a
    clone): every rank died with `ImportError: cannot import name '__version__' from 'qtool'` (the ranks ran
    `python -m qtool`, and the current folder shadowed the package), then the launcher offered --resume."""
    (tmp_path / "qtool").mkdir()
    r = _installed_qtool(["quantize", tiny_bf16, "-o", "q", "--recipe", "qwen35-nvfp4-experts", "--backend", "rtn",
                          "--samples", "2", "--seq-len", "16", "--quiet", "--nproc", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert (tmp_path / "q" / "qtool-manifest.json").exists()
