"""A streamed job's start imports what it runs: transformers' decoder module without scikit-learn (its
assisted-generation candidate generator imports sklearn.metrics where scikit-learn is installed: 1.1 s
of the 4 s import on the lent GPU machine). scikit-learn is not a qtool dependency, so a stand-in
package that transformers detects as installed shows what a user's environment with it does."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
{prepare}
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
print("sklearn.metrics" in sys.modules)
"""


def _imports_sklearn(tmp_path, prepare: str) -> bool:
    pkg = tmp_path / "site" / "sklearn"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("__version__ = '1.7.0'\n")
    (pkg / "metrics.py").write_text("def roc_curve(*a, **k):\n    raise AssertionError('not for qtool')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", PROBE.format(prepare=prepare)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1] == "True"


def test_the_decoder_module_comes_without_scikit_learn(tmp_path):
    assert _imports_sklearn(tmp_path, "")  # the stand-in is what transformers would import
    assert not _imports_sklearn(tmp_path, "from qtool.stream.warm_import import skip_unused_imports\n"
                                          "skip_unused_imports()")


def test_the_background_import_skips_it_too(tmp_path):
    assert not _imports_sklearn(tmp_path, "from qtool.stream import warm_import\n"
                                          "warm_import.start(); warm_import.join()")
