"""Mixed recipes (nvidia's NVFP4-V2 form): NVFP4 routed experts + FP8 W8A8 attention, shared expert and GDN
projections + FP8 KV, as one ModelOpt MIXED_PRECISION checkpoint or a compressed-tensors one.

Oracles: ModelOpt 0.47's own export of the same mixed config on the tiny model (every tensor's bytes and the
configs' quantization entries); `qtool verify` on both formats. The real engine loaders are the cases
quantize-mixed-* of tests/engines/test_loaders.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_tensor
from qtool.recipes import OutFormat, Scheme, WeightScale, load_recipe

TP2 = {"tp": 2, "gpus": "2x97887MiB"}


def _tensors(root):
    ts = {n: read_tensor(i) for n, i in Checkpoint.open(root).tensors.items()}
    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for n, t in ts.items()}


def _v2(weight_scale: WeightScale = WeightScale.MAX):
    r = load_recipe("qwen35-nvfp4-v2")
    return dataclasses.replace(r, nvfp4=dataclasses.replace(r.nvfp4, weight_scale=weight_scale))


@pytest.fixture(scope="module")
def modelopt_mixed_export(tiny_bf16, tmp_path_factory):
    """ModelOpt's own export of the V2 mix (max calibration: its MSE sweep needs a CUDA device)."""
    from qtool.fixtures.quantized import build_nvfp4_modelopt, mixed_v2_cfg

    return build_nvfp4_modelopt(tiny_bf16, tmp_path_factory.mktemp("mo") / "mixed", quant_cfg=mixed_v2_cfg())


@pytest.fixture(scope="module")
def q_mixed(tiny_bf16, calib_ids, tmp_path_factory):
    from qtool.ops.quantize import run

    root = tmp_path_factory.mktemp("qmixed")
    run(tiny_bf16, out=root / "mo", recipe=_v2(), calib_ids=calib_ids)
    run(tiny_bf16, out=root / "ct", recipe=_v2(WeightScale.MSE_SWEEP), calib_ids=calib_ids, format="compressed-tensors")
    return root / "mo", root / "ct"


def test_mixed_modelopt_bit_identical_to_modelopt_export(q_mixed, modelopt_mixed_export):
    mine, ref = _tensors(q_mixed[0]), _tensors(modelopt_mixed_export)
    assert set(ref) <= set(mine) and {n for n in set(mine) - set(ref) if not n.startswith("mtp.")} == set()
    differ = [n for n in ref if mine[n].dtype != ref[n].dtype or not torch.equal(mine[n], ref[n])]
    assert differ == []
    fp8 = [n for n, i in Checkpoint.open(q_mixed[0]).tensors.items() if i.dtype == "F8_E4M3" and n.endswith(".weight")]
    assert any(".self_attn.q_proj." in n for n in fp8) and any(".linear_attn.out_proj." in n for n in fp8)
    assert not any("in_proj_a" in n or "in_proj_b" in n or "mtp." in n for n in fp8)
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        a = json.loads((q_mixed[0] / name).read_text())[key]
        b = json.loads((modelopt_mixed_export / name).read_text())[key]
        assert {k: v for k, v in a.items() if k != "producer"} == {k: v for k, v in b.items() if k != "producer"}
    assert b["quant_algo"] == "MIXED_PRECISION"


def test_mixed_ct_names_and_groups(q_mixed):
    ct = q_mixed[1]
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    formats = {g["format"] for g in qc["config_groups"].values()}
    assert formats == {"nvfp4-pack-quantized", "float-quantized"}
    assert any("in_proj_a" in p for p in qc["ignore"]) and qc["kv_cache_scheme"]["num_bits"] == 8
    t = Checkpoint.open(ct).tensors
    q = "model.language_model.layers.3.self_attn.q_proj."
    assert (t[q + "weight"].dtype, t[q + "weight_scale"].shape, t[q + "input_scale"].shape) == ("F8_E4M3", (1,), (1,))
    assert "model.language_model.layers.3.self_attn.k_scale" in t


@pytest.mark.parametrize("form", [0, 1])
def test_verify_passes_on_the_mixed_outputs(q_mixed, form):
    from qtool.ops.verify import VerifyOptions, verify

    rep = verify(q_mixed[form], VerifyOptions(**TP2))
    assert rep.ok, [f.to_json() for f in rep.findings if f.is_error][:3]


def test_mixed_recipe_plans_fp8_linears_without_source_bytes(tiny_bf16, tmp_path):
    from qtool.ops.quantize import QuantizeOptions, plan

    p = plan(QuantizeOptions(tiny_bf16, tmp_path / "o", load_recipe("qwen35-nvfp4-v2"), samples=2, seq_len=32))
    assert set(p.layers[0].fp8) == {
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.out_proj",
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj",
    }
    assert "self_attn.o_proj" in p.layers[3].fp8 and p.layers[3].scheme is Scheme.NVFP4
    computed = {s.name for s in p.layers[0].specs if s.source is None}
    assert "model.language_model.layers.0.linear_attn.in_proj_z.input_scale" in computed
    assert "model.language_model.layers.0.linear_attn.in_proj_a.weight" not in computed


def test_mixed_recipe_with_a_peer_backend_is_refused(tiny_bf16, tmp_path):
    from qtool.errors import UsageError
    from qtool.ops.quantize import QuantizeOptions, plan

    with pytest.raises(UsageError, match="fp8 groups"):
        plan(QuantizeOptions(tiny_bf16, tmp_path / "o", _v2(), backend="llmcompressor", samples=2, seq_len=32))
    with pytest.raises(UsageError, match="cannot hold nvfp4"):
        plan(QuantizeOptions(tiny_bf16, tmp_path / "o", load_recipe("qwen35-nvfp4-v2"), format=OutFormat.AWQ))
