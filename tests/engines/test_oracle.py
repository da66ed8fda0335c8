"""Oracle: the engines' REAL is_layer_excluded / should_ignore_layer vs qtool's models, same cases.

Runs only when QTOOL_ENGINES_PYTHON points at a python with vllm==0.33.0 and sglang==0.5.23
(e.g. /work/engines-venv/bin/python). Compares matching semantics for the newest releases on the
runtime names qtool derives; hard-coded construction rules (router, mtp.fc, SGLang MTP/vision) are
model-construction facts outside these functions and are skipped here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qtool.engines import Flavour, PartialFusedExclusion, sglang, unit_of, vllm

from .qwen35_modules import flatten, model_modules
from .test_engines import HYBRID, NVIDIA_IGNORE

pytestmark = pytest.mark.engines
PY = os.environ.get("QTOOL_ENGINES_PYTHON")
if not PY:
    pytest.skip("QTOOL_ENGINES_PYTHON not set", allow_module_level=True)

L = "model.language_model.layers"
IGNORES = {
    "modelopt": [
        NVIDIA_IGNORE,
        HYBRID,
        ["*.layers.1.*"],
        ["*.layers.1*"],
        [f"{L}.1"],
        [f"{L}.3.self_attn.q_proj"],
        [f"{L}.3.self_attn.q_proj", f"{L}.3.self_attn.k_proj", f"{L}.3.self_attn.v_proj"],
        [f"{L}.0.linear_attn.in_proj_qkv"],
        [f"{L}.2.mlp.experts.0.gate_proj"],
        ["*.mlp.gate", "*.mlp.shared_expert_gate", "mtp.fc", "mtp.layers.0*"],
        ["model.language_model.layers..mlp.gate"],
        [f"{L}.4.mlp.experts*", "model.layers.4.mlp.experts*"],
    ],
    "compressed-tensors": [
        ["lm_head", r"re:.*visual\.", r"re:^mtp\.", r"re:.*mlp\.gate$", r"re:.*mlp\.shared_expert\."],
        [r"re:.*\.layers\.1\.", r"re:.*self_attn\."],
        [f"{L}.0.mlp.shared_expert.down_proj", f"{L}.3.self_attn.q_proj"],
        [r"re:model\.language_model\..*"],
        [r"re:(?!mtp\.).*\.layers\.0\.mlp\.experts", "self_attn.o_proj"],
        [f"{L}.0.mlp.shared_expert"],
    ],
}


def _generated():
    from . import test_patterns as tp

    for fl in IGNORES:
        for split in (tp._nvidia, tp._hybrid):
            IGNORES[fl].append(tp.compact_ignore_patterns(*tp._split(tp.model_modules(), split), fl))


_generated()


def _modules():
    g = model_modules(n_layers=13, n_experts=2, vision_depth=1)
    mods = flatten(g)
    # one representative module per unit keeps the case count small
    seen, out = set(), []
    for m in mods:
        u = unit_of(m).name
        if u not in seen:
            seen.add(u)
            out.append(m)
    # plus a second shard of fused units, for the all-or-nothing rule
    return out + [m for m in mods if m.endswith((".k_proj", ".in_proj_z", ".in_proj_a"))]


def _ours(eng, m, ign, fl):
    mod = vllm if eng == "vllm" else sglang
    try:
        return mod.is_excluded(m, ign, quant_method=fl)
    except PartialFusedExclusion:
        return "partial"


def test_oracle_matches_models():
    cases, ours = [], []
    for fl, lists in IGNORES.items():
        for ign in lists:
            for m in _modules():
                u = unit_of(m)
                for eng in ("vllm", "sglang"):
                    if eng == "vllm":
                        if vllm.hardcoded_unquantized(m, vllm.parse_version("vllm"), Flavour(fl)):
                            continue
                        prefix = vllm.runtime_name(m)
                    else:
                        if sglang.hardcoded_unquantized(m, fl):
                            continue
                        prefix = sglang.runtime_name(m)
                    kind = "moe" if u.kind == "moe" else "linear"
                    cases.append(
                        {
                            "engine": eng,
                            "flavour": fl,
                            "prefix": prefix,
                            "kind": kind,
                            "mtp": m.startswith("mtp."),
                            "ignore": ign,
                            "module": m,
                        }
                    )
                    ours.append(_ours(eng, m, ign, fl))
    runner = Path(__file__).with_name("oracle_runner.py")
    r = subprocess.run([PY, str(runner)], input=json.dumps(cases), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    real = json.loads(r.stdout)
    diffs = [
        (c["engine"], c["flavour"], c["module"], c["ignore"][:3], o, t)
        for c, o, t in zip(cases, ours, real, strict=True)
        if o != t
    ]
    print(f"oracle: {len(cases)} cases, {len(diffs)} differences", file=sys.stderr)
    assert {True, False, "partial"} <= set(real)  # the oracle really ran every kind of outcome
    assert not diffs, diffs[:20]
