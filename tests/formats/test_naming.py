"""Format detection and lossless NVFP4 flavour conversion."""

from __future__ import annotations

import pytest
import torch

from qtool.formats import naming, nvfp4
from qtool.formats.naming import QuantFormat as F


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"weight": "BF16"}, F.BF16),
        ({"weight": torch.bfloat16, "bias": torch.bfloat16}, F.BF16),
        ({"weight": "F16"}, F.FP16),
        ({"weight": "torch.float32"}, F.FP32),
        ({"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32", "input_scale": "F32"}, F.NVFP4),
        ({"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32}, F.NVFP4),
        (
            {
                "weight_packed": "U8",
                "weight_scale": "F8_E4M3",
                "weight_global_scale": "F32",
                "input_global_scale": "F32",
            },
            F.NVFP4_CT,
        ),
        ({"weight_packed": "U8", "weight_scale": "U8"}, F.MXFP4_CT),
        ({"weight": "F8_E4M3", "weight_scale": "F32", "input_scale": "F32"}, F.FP8),
        ({"weight": "F8_E4M3", "weight_scale_inv": "F32"}, F.FP8_BLOCK),
        ({"qweight": "I32", "qzeros": "I32", "scales": "F16"}, F.AWQ),
        ({"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"}, F.GPTQ),
        ({"weight_packed": "I32", "weight_scale": "BF16", "weight_shape": "I64"}, F.INT4_CT),
        (
            {"weight_packed": "I32", "weight_scale": "BF16", "weight_shape": "I64", "weight_zero_point": "I32"},
            F.INT4_CT,
        ),
        ({"weight": "I8", "weight_scale": "BF16"}, F.INT8_CT),
        ({"weight": "U8"}, F.UNKNOWN),
        ({"k_scale": "F32"}, F.UNKNOWN),
        ({}, F.UNKNOWN),
    ],
)
def test_detect_format(params, expected):
    assert naming.detect_format(params) is expected


def test_missing_params_and_grouping():
    assert naming.missing_params(F.NVFP4, ["weight", "weight_scale"]) == ["weight_scale_2"]
    assert naming.missing_params(F.AWQ, ["qweight", "qzeros", "scales"]) == []
    groups = naming.group_by_module(
        {"m.layers.0.mlp.down_proj.weight": torch.uint8, "m.layers.0.mlp.down_proj.weight_scale": "F8_E4M3"}
    )
    assert groups == {"m.layers.0.mlp.down_proj": {"weight": "U8", "weight_scale": "F8_E4M3"}}
    assert naming.MODELOPT_NVFP4.kv_scale_names("x.self_attn") == (
        "x.self_attn.k_proj.k_scale",
        "x.self_attn.v_proj.v_scale",
    )
    assert naming.CT_NVFP4.kv_scale_names("x.self_attn") == ("x.self_attn.k_scale", "x.self_attn.v_scale")


def test_reciprocal_is_not_an_involution_in_float32():
    """Measured: fl(1/fl(1/x)) != x for ~17% of float32 values (uniform over normal bit patterns;
    ~12% for realistic weight_scale_2 = bf16 amax / 2688). Hence the recorded originals."""
    torch.manual_seed(0)
    bits = torch.randint(0x00800000, 0x7E800000, (1_000_000,), dtype=torch.int32)
    x = bits.view(torch.float32)
    frac = ((1 / (1 / x)).view(torch.int32) != bits).float().mean().item()
    assert 0.15 < frac < 0.19
    ws2 = (torch.rand(200_000) * 2).bfloat16().float() / 2688.0
    frac_ws2 = ((1 / (1 / ws2)) != ws2).float().mean().item()
    assert 0.08 < frac_ws2 < 0.16


def _modelopt_module(ws2: float, input_scale: float):
    q = nvfp4.quantize(torch.randn(8, 32))
    return {
        "weight": q.packed,
        "weight_scale": q.block_scale,
        "weight_scale_2": torch.tensor(ws2, dtype=torch.float32),
        "input_scale": torch.tensor(input_scale, dtype=torch.float32),
        "bias": torch.zeros(8),
    }


def test_convert_modelopt_to_ct_and_back_exact():
    torch.manual_seed(1)
    vals = (torch.rand(400) * 1e-3 + 1e-6).tolist()
    n_recorded = 0
    for ws2, inp in zip(vals[::2], vals[1::2], strict=True):
        mo = _modelopt_module(ws2, inp)
        ct = naming.convert_nvfp4(mo, F.NVFP4, F.NVFP4_CT)
        t = ct.tensors
        assert set(t) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "bias"}
        assert t["weight_packed"] is mo["weight"] and t["weight_scale"] is mo["weight_scale"]
        assert t["weight_global_scale"].shape == (1,) and t["weight_global_scale"].dtype == torch.float32
        assert t["weight_global_scale"].item() == (1 / mo["weight_scale_2"]).item()
        assert t["input_global_scale"].item() == (1 / mo["input_scale"]).item()
        assert naming.detect_format({k: v.dtype for k, v in t.items()}) is F.NVFP4_CT
        n_recorded += len(ct.originals)
        back = naming.convert_nvfp4(t, F.NVFP4_CT, F.NVFP4, originals=ct.originals).tensors
        assert set(back) == set(mo)
        for k in ("weight_scale_2", "input_scale"):
            assert back[k].shape == () and back[k].view(torch.int32).item() == mo[k].view(torch.int32).item()
        assert back["weight"] is mo["weight"]
    assert n_recorded > 0  # some values really needed their originals


def test_convert_without_originals_is_off_by_at_most_one_ulp():
    torch.manual_seed(2)
    ws2 = torch.rand(5000) * 1e-3 + 1e-7
    mo = {"weight_scale_2": ws2}  # batched [E] global scales -> CT [E, 1]
    ct = naming.convert_nvfp4(mo, F.NVFP4, F.NVFP4_CT)
    assert ct.tensors["weight_global_scale"].shape == (5000, 1)
    assert set(ct.originals) == {"weight_scale_2"}
    plain = naming.convert_nvfp4(ct.tensors, F.NVFP4_CT, F.NVFP4).tensors["weight_scale_2"]
    ulps = (plain.view(torch.int32) - ws2.view(torch.int32)).abs()
    assert ulps.max().item() == 1 and (ulps != 0).any()
    exact = naming.convert_nvfp4(ct.tensors, F.NVFP4_CT, F.NVFP4, originals=ct.originals).tensors
    assert torch.equal(exact["weight_scale_2"].view(torch.int32), ws2.view(torch.int32))


def test_ct_to_modelopt_to_ct_exact_and_stale_originals_ignored():
    gs = torch.tensor([26466.46], dtype=torch.float32)
    ct = {"weight_global_scale": gs}
    mo = naming.convert_nvfp4(ct, F.NVFP4_CT, F.NVFP4)
    assert mo.tensors["weight_scale_2"].shape == ()
    again = naming.convert_nvfp4(mo.tensors, F.NVFP4, F.NVFP4_CT, originals=mo.originals)
    assert torch.equal(again.tensors["weight_global_scale"].view(torch.int32), gs.view(torch.int32))
    # originals that no longer match the current value are not used
    stale = {"weight_global_scale": torch.tensor([1.0])}
    other = naming.convert_nvfp4(mo.tensors, F.NVFP4, F.NVFP4_CT, originals=stale)
    assert other.tensors["weight_global_scale"].item() == (1 / mo.tensors["weight_scale_2"]).item()


def test_dequant_same_in_both_flavours():
    torch.manual_seed(3)
    q = nvfp4.quantize(torch.randn(16, 64).bfloat16())
    mo = {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.weight_scale_2}
    ct = naming.convert_nvfp4(mo, F.NVFP4, F.NVFP4_CT).tensors
    a = nvfp4.dequantize(mo["weight"], mo["weight_scale"], mo["weight_scale_2"], dtype=torch.float32)
    b = nvfp4.dequantize(ct["weight_packed"], ct["weight_scale"], 1 / ct["weight_global_scale"], dtype=torch.float32)
    assert torch.allclose(a, b, rtol=2**-22, atol=0)


ct_conv = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4")


def test_matches_compressed_tensors_converter():
    torch.manual_seed(4)
    mo = _modelopt_module(3.3e-5, 7.7e-4)
    full = {f"layer.mlp.down_proj.{k}": v for k, v in mo.items()}
    ref = ct_conv.ModelOptNvfp4Converter(targets=["re:.*down_proj$"]).process(dict(full))
    ours = naming.convert_nvfp4(mo, F.NVFP4, F.NVFP4_CT).tensors
    assert {k.rpartition(".")[2] for k in ref} == set(ours)
    for k, v in ours.items():
        r = ref[f"layer.mlp.down_proj.{k}"]
        # CT keeps the 0-d shape; we write [1] as llm-compressor checkpoints do.
        assert torch.equal(r.reshape(v.shape).view(torch.uint8), v.view(torch.uint8)), k
