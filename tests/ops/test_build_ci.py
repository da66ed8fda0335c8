"""scripts/ci-rebuild.sh: rebuilds what changed, publishes manifests, exits 3 on a verification error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """
name: NAME
sources:
  nvfp4: {{path: {nv}}}
steps:
  - {{id: patched, op: patch-config, input: nvfp4, with: {{fixes: [router-ignore]}}}}
  - {{id: check, op: verify, input: patched, with: {{engine: both, tp: TP}}}}
"""


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_ci_rebuild(tmp_path, tiny_nvfp4_modelopt_nomtp):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    body = RECIPE.format(nv=tiny_nvfp4_modelopt_nomtp)
    good.write_text(body.replace("NAME", "good").replace("TP", "1"))
    bad.write_text(body.replace("NAME", "bad").replace("TP", "4"))  # tiny dims fail TP=4 verification
    env = {
        **os.environ,
        "QTOOL": f"{sys.executable} -m qtool",
        "BUILD_ROOT": str(tmp_path / "b"),
        "QTOOL_CACHE_DIR": str(tmp_path / "qc"),
    }

    def run(*r):
        return subprocess.run(
            ["bash", str(ROOT / "scripts" / "ci-rebuild.sh"), *map(str, r)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    p = run(good, bad)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "good: rebuilt (patched check)" in p.stdout and "bad: failed (3)" in p.stdout
    man = json.loads((tmp_path / "b" / "manifests" / "good.manifest.json").read_text())
    assert [s["id"] for s in man["build"]["steps"]] == ["patched", "check"]
    assert not (tmp_path / "b" / "manifests" / "bad.manifest.json").exists()
    p = run(good)
    assert p.returncode == 0 and "good: up to date" in p.stdout, p.stdout + p.stderr
