"""qtool convert: ModelOpt <-> compressed-tensors NVFP4, bit-identical round trips, linked shards."""

from __future__ import annotations

import json
import os

import torch

from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_tensor


def _tensors(root):
    """name -> tensor (FP8 viewed as uint8, so torch.equal compares bytes)."""
    ts = {n: read_tensor(i) for n, i in Checkpoint.open(root).tensors.items()}
    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for n, t in ts.items()}


def test_modelopt_to_ct_and_back_bit_identical(tiny_nvfp4_modelopt, tmp_path):
    from qtool.ops.convert import run

    rep = run(tiny_nvfp4_modelopt, out=tmp_path / "ct", to="compressed-tensors")
    assert rep["problems"] == [] and rep["linked_shards"]
    ct = _tensors(tmp_path / "ct")
    mo = _tensors(tiny_nvfp4_modelopt)
    p = "model.language_model.layers.1.mlp.experts.3.gate_proj."
    assert torch.equal(ct[p + "weight_packed"], mo[p + "weight"])
    assert abs(float(ct[p + "weight_global_scale"]) * float(mo[p + "weight_scale_2"]) - 1) < 1e-6
    assert "model.language_model.layers.3.self_attn.k_scale" in ct
    s = rep["linked_shards"][0]
    assert os.stat(tmp_path / "ct" / s).st_ino == os.stat(tiny_nvfp4_modelopt / s).st_ino
    run(tmp_path / "ct", out=tmp_path / "mo", to="modelopt")
    back = _tensors(tmp_path / "mo")
    assert set(back) == set(mo) and all(back[n].dtype == mo[n].dtype and torch.equal(back[n], mo[n]) for n in mo)
    for f in ("config.json", "hf_quant_config.json"):
        assert json.loads((tmp_path / "mo" / f).read_text()) == json.loads((tiny_nvfp4_modelopt / f).read_text())


def test_ct_to_modelopt_and_back_bit_identical(tiny_nvfp4_ct, tmp_path):
    from qtool.ops.convert import run

    rep = run(tiny_nvfp4_ct, out=tmp_path / "mo", to="modelopt")
    assert rep["problems"] == []
    assert (tmp_path / "mo" / "hf_quant_config.json").is_file()
    run(tmp_path / "mo", out=tmp_path / "ct", to="compressed-tensors")
    a, b = _tensors(tmp_path / "ct"), _tensors(tiny_nvfp4_ct)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in b)
    assert json.loads((tmp_path / "ct" / "config.json").read_text()) == json.loads(
        (tiny_nvfp4_ct / "config.json").read_text()
    )


def test_same_flavour_is_a_usage_error(tiny_nvfp4_ct, tmp_path):
    from qtool.cli.main import main

    assert main(["convert", str(tiny_nvfp4_ct), "-o", str(tmp_path / "x"), "--to", "compressed-tensors"]) == 2
