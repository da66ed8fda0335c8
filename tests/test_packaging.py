"""The installable package: a wheel carries every shipped recipe, and `qtool build` runs from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """qtool's wheel (built from this tree) installed into a folder of its own; run with PYTHONPATH there."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            str(ROOT),
            "-w",
            str(tmp / "dist"),
        ],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    wheel = next((tmp / "dist").glob("qtool-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
        check=True,
        capture_output=True,
    )
    return tmp / "site"


def _qtool(site: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "qtool", *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_the_wheel_ships_every_recipe(installed, tmp_path):
    p = _qtool(installed, ["recipes", "list", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    shipped = ROOT / "qtool" / "data" / "recipes"
    assert sorted(got["quantize"]) == sorted(f.stem for f in shipped.glob("*.yaml"))
    assert sorted(got["build"]) == sorted(f.stem for f in (shipped / "build").glob("*.yaml"))
    where = _qtool(installed, ["recipes", "show", "qwen35-nvfp4-experts", "--json"], tmp_path)
    assert Path(json.loads(where.stdout)["file"]).is_relative_to(installed)  # the installed copy, not the repo's


def test_build_runs_from_another_directory(installed, tmp_path):
    """Found as: `qtool build recipes/build/qwen35-397b-awq-int4.yaml` from anywhere but the repo root said
    "recipe file not found: recipes/qwen35-awq-int4.yaml" (resolved against the working directory)."""
    mine = tmp_path / "mine"
    (mine / "recipes").mkdir(parents=True)
    (mine / "recipes" / "experts.yaml").write_text(
        (ROOT / "qtool" / "data" / "recipes" / "qwen35-nvfp4-experts.yaml")
        .read_text()
        .replace("name: qwen35-nvfp4-experts", "name: experts")
    )
    (mine / "build.yaml").write_text(
        "name: mine\nsources:\n  bf16: {builtin: tiny-bf16}\nsteps:\n"
        "  - {id: q, op: quantize, input: bf16, "
        "with: {recipe: recipes/experts.yaml, samples: 2, seq_len: 16}}\n"  # docs-ref: not a repository path
        "  - {id: q2, op: quantize, input: bf16, "
        "with: {recipe: recipes/qwen35-nvfp4-experts.yaml, samples: 2, seq_len: 16}}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = _qtool(installed, ["build", str(mine / "build.yaml"), "--dry-run", "--json"], elsewhere)
    assert p.returncode == 0, p.stdout + p.stderr
    steps = {s["id"]: s for s in json.loads(p.stdout)["steps"]}
    assert steps["q"]["with"]["recipe"] == str((mine / "recipes" / "experts.yaml").resolve())  # beside the recipe
    assert steps["q2"]["with"]["recipe"] == "qwen35-nvfp4-experts"  # not beside it: the shipped one
    assert all(s["validation"]["status"] == "planned" for s in steps.values()), steps
    shipped = _qtool(installed, ["build", "demo-tiny", "--dry-run", "--json"], elsewhere)  # by name
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
