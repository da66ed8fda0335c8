"""The Gated-DeltaNet kernel: flash-linear-attention's when `fla` imports on CUDA, PyTorch's on CPU whatever
is installed (fla's Triton kernels take CUDA tensors only), and the choice is in the manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
            "    raise RuntimeError('fla kernel called')\n"
        )
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
    from full_model import fixture_dir

    pkg = tmp_path / "site" / "fla"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "def chunk_gated_delta_rule(*a, **k):\n    raise RuntimeError('fla kernel called')\n"
    )
    out = tmp_path / "kv"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
        "QTOOL_CACHE_DIR": str(tmp_path / "cache"),
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "calibrate-kv",
            str(fixture_dir(request, "tiny_nvfp4_ct")),
            "-o",
            str(out),
            "--replace-scales",
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = json.loads((out / "qtool-manifest.json").read_text())
    assert m["run"]["kernels"] == {"gated_deltanet": "torch", "routed_experts": "eager"}


# a stand-in for fla-core's layout: the kernel's module under `fla.ops`, its l2norm under `fla.modules.norm`,
# and package __init__s that import much more (here: marker modules, each recorded when imported)
FLA_LAYOUT = {
    "fla/__init__.py": "__version__ = '0.6.0'\n",
    "fla/ops/__init__.py": "import fla_marker_all_families\nHELPER = 1\n"
    "from .gated_delta_rule import chunk_gated_delta_rule\n",
    "fla/ops/gated_delta_rule/__init__.py": "from .chunk import chunk_gated_delta_rule\n"
    "from .fused_recurrent import fused_recurrent_gated_delta_rule\n",
    "fla/ops/gated_delta_rule/chunk.py": "import fla_dep_probe\nfrom fla.modules.norm.l2norm import l2norm_fwd\n{needs}"
    "def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,\n"
    "                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):\n"
    "    raise RuntimeError('fla kernel called')\n",
    "fla/ops/gated_delta_rule/fused_recurrent.py": "def fused_recurrent_gated_delta_rule(q, k, v, g, beta, "
    "scale=None, initial_state=None,\n"
    "                                     output_final_state=False, use_qk_l2norm_in_kernel=False):\n"
    "    raise RuntimeError('fla kernel called')\n",
    "fla/modules/__init__.py": "import fla_marker_activations\n",
    "fla/modules/norm/__init__.py": "import fla_marker_norms\n",
    "fla/modules/norm/l2norm.py": "def l2norm_fwd(x):\n    return x\n",
    "fla_marker_all_families.py": "",
    "fla_marker_activations.py": "",
    "fla_marker_norms.py": "",
    # a module outside fla that the kernel imports (as fla's import torch._dynamo): counts its executions
    "fla_dep_probe.py": "import sys\nsys.fla_dep_loads = getattr(sys, 'fla_dep_loads', 0) + 1\n",
}

IMPORT_PROBE = textwrap.dedent("""
    import json, sys
    from qtool.stream import kernels, warm_import
    if sys.argv[1] == "fla-first":  # fla imported whole before the job's import (a library user's process)
        import fla.ops
        first = fla.ops
    if sys.argv[1] in ("qtool", "fla-first"):
        warm_import.start(); warm_import.join()  # a streamed job's background import
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    import fla.ops.gated_delta_rule as gdr
    print(json.dumps({
        "bound_to_fla": kernels._implementation(m.torch_chunk_gated_delta_rule) is gdr.chunk_gated_delta_rule,
        "markers": sorted(n for n in sys.modules if n.startswith("fla_marker")),
        "ops_opened": hasattr(sys.modules["fla.ops"], "HELPER"),
        "dep_loads": sys.fla_dep_loads,
        **({"same_fla_ops": sys.modules["fla.ops"] is first} if sys.argv[1] == "fla-first" else {}),
    }))
""")


def _import_with_fla_layout(tmp_path, how: str, needs: str = "") -> dict:
    site = tmp_path / "site"
    for rel, text in FLA_LAYOUT.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text.replace("{needs}", needs))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "QTOOL_CACHE_DIR": str(tmp_path / "cache"),
    }
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE, how], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_streamed_jobs_import_takes_fla_s_kernel_without_the_rest_of_fla(tmp_path):
    """fla-core's package __init__s import all its op families and torch._inductor (1.7 s of the decoder
    module's import on the 2-core VM): a streamed job imports the Gated-DeltaNet kernel's modules alone, and
    transformers binds the same function it binds with fla imported whole."""
    plain = _import_with_fla_layout(tmp_path / "a", "plain")
    assert plain == {
        "bound_to_fla": True,
        "ops_opened": True,
        "dep_loads": 1,
        "markers": ["fla_marker_activations", "fla_marker_all_families", "fla_marker_norms"],
    }
    assert _import_with_fla_layout(tmp_path / "b", "qtool") == {
        "bound_to_fla": True,
        "markers": [],
        "ops_opened": False,
        "dep_loads": 1,
    }


def test_an_fla_whose_kernel_needs_a_package_init_is_imported_whole(tmp_path):
    """A layout where the kernel's module uses what `fla.ops`' __init__ defines: the import alone fails, is
    undone, and transformers imports fla whole and binds its kernel, as without qtool. What the attempt
    imported outside fla stays imported once (a torch module imported twice would be two copies)."""
    got = _import_with_fla_layout(tmp_path, "qtool", needs="from fla.ops import HELPER\n")
    assert got == {
        "bound_to_fla": True,
        "ops_opened": True,
        "dep_loads": 1,
        "markers": ["fla_marker_activations", "fla_marker_all_families", "fla_marker_norms"],
    }


def test_an_fla_imported_whole_already_is_left_as_it_is(tmp_path):
    """A process that imported fla whole before the job (a library user's): its `fla.ops` stays the one
    module object, not replaced by one without its __init__."""
    got = _import_with_fla_layout(tmp_path, "fla-first")
    assert got == {
        "bound_to_fla": True,
        "ops_opened": True,
        "dep_loads": 1,
        "same_fla_ops": True,
        "markers": ["fla_marker_activations", "fla_marker_all_families", "fla_marker_norms"],
    }


def test_the_real_fla_kernel_is_imported_alone_where_fla_core_is_installed():
    """With fla-core (and Triton) installed: transformers binds fla-core's own chunk_gated_delta_rule and
    none of its other op families is imported."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("fla-core and triton are not installed (the gpu extra)")
    probe = textwrap.dedent("""
        import json, sys, warnings
        warnings.simplefilter("ignore")
        from qtool.stream import kernels, warm_import
        warm_import.start(); warm_import.join()
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        print(json.dumps([kernels._implementation(m.torch_chunk_gated_delta_rule) is chunk_gated_delta_rule,
                          sorted(n for n in ("fla.ops.rwkv7", "fla.ops.gla", "fla.modules.activations")
                                 if n in sys.modules)]))
    """)
    r = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, []]
