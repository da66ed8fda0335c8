"""The Gated-DeltaNet kernel: flash-linear-attention's when `fla` imports on CUDA, PyTorch's on CPU whatever
is installed (fla's Triton kernels take CUDA tensors only), and the choice is in the manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, sys
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    from qtool.stream.kernels import select_gdn_kernel
    out = {}
    for dev in sys.argv[1:]:
        kernel = select_gdn_kernel(dev)
        fn = m.torch_chunk_gated_delta_rule
        out[dev] = [kernel, getattr(fn, "__module__", ""), fn.__name__]
    print(json.dumps(out))
""")


def _probe(tmp_path, devices, fake_fla: bool, env_extra=None) -> dict:
    path = [str(ROOT)]
    if fake_fla:
        # a stand-in `fla` package exposing the function transformers looks for (its real one needs CUDA)
        pkg = tmp_path / "site" / "fla"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(
            "def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,\n"
            "                           use_qk_l2norm_in_kernel=False, **kw):\n"
            "    raise RuntimeError('fla kernel called')\n")
        path.insert(0, str(tmp_path / "site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env_extra or {})}
    r = subprocess.run([sys.executable, "-c", PROBE, *devices], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_without_fla_the_reference_is_used_everywhere(tmp_path):
    got = _probe(tmp_path, ["cuda", "cpu"], fake_fla=False)
    assert got["cuda"][0] == got["cpu"][0] == "torch"
    assert got["cpu"][1].startswith("transformers.")


def test_with_fla_cuda_takes_it_and_cpu_keeps_the_reference(tmp_path):
    got = _probe(tmp_path, ["cuda", "cpu", "cuda"], fake_fla=True)
    # cuda: transformers' binding (which calls fla), recorded as fla; cpu: the reference function itself
    assert got["cuda"][0].startswith("fla") and got["cpu"][0] == "torch"
    assert got["cpu"][1].startswith("transformers.") and got["cpu"][2] == "torch_chunk_gated_delta_rule"


def test_the_reference_can_be_asked_for_on_cuda(tmp_path):
    got = _probe(tmp_path, ["cuda"], fake_fla=True, env_extra={"QTOOL_GDN_KERNEL": "torch"})
    assert got["cuda"][0] == "torch"


def test_a_cpu_layer_runs_with_fla_installed_and_the_manifest_names_the_kernel(tmp_path, request):
    """A CPU calibrate-kv with (a stand-in) fla importable: the reference computes (the stand-in would raise),
    and the manifest's run section says so."""
    from test_calibrate_kv_support import fixture_dir

    pkg = tmp_path / "site" / "fla"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def chunk_gated_delta_rule(*a, **k):\n    raise RuntimeError('fla kernel called')\n")
    out = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
           "QTOOL_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "qtool", "calibrate-kv", str(fixture_dir(request, "tiny_nvfp4_ct")),
                        "-o", str(out), "--replace-scales", "--samples", "2", "--seq-len", "32", "--quiet"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = json.loads((out / "qtool-manifest.json").read_text())
    assert m["run"]["kernels"] == {"gated_deltanet": "torch", "routed_experts": "eager"}
