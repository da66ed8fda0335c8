"""FP8 E4M3 codec."""

from __future__ import annotations

import pytest
import torch

from qtool.formats import fp8


def test_kv_scale():
    assert fp8.kv_scale_from_amax(448.0).item() == 1.0
    s = fp8.kv_scale_from_amax(torch.tensor(12.5, dtype=torch.bfloat16))
    assert s.dtype == torch.float32 and s.item() == pytest.approx(12.5 / 448)


def test_per_tensor_exact_values():
    w = torch.tensor([[448.0, -448.0, 1.0, 0.0], [17.0, 18.0, 0.001, 500.0]])
    q = fp8.quantize_per_tensor(w, scale=1.0)
    # 17 is a tie between 16 and 18 (3 mantissa bits) -> even mantissa 16; 0.001 rounds up to the
    # smallest subnormal 2**-9; 500 saturates.
    assert q.weight.float().tolist() == [[448.0, -448.0, 1.0, 0.0], [16.0, 18.0, 2.0**-9, 448.0]]
    auto = fp8.quantize_per_tensor(w)
    assert auto.scale.item() == pytest.approx(500 / 448) and auto.scale.shape == ()
    assert auto.weight.float().abs().max().item() == 448.0


def test_batched_and_zero_matrix():
    w = torch.randn(3, 16, 32)
    w[1] = 0
    q = fp8.quantize_per_tensor(w)
    assert q.scale.shape == (3,) and q.scale[1].item() == 1.0
    assert not q.weight.float().isnan().any()
    for e in (0, 2):
        assert torch.equal(q.weight[e].view(torch.uint8), fp8.quantize_per_tensor(w[e]).weight.view(torch.uint8))


@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_round_trip_error(mode):
    torch.manual_seed(0)
    w = torch.randn(2, 200, 300).bfloat16()
    q = {
        "tensor": fp8.quantize_per_tensor,
        "channel": fp8.quantize_per_channel,
        "block": lambda x: fp8.quantize_block(x, (128, 128)),
    }[mode](w)
    assert q.weight.shape == w.shape and q.weight.dtype == torch.float8_e4m3fn
    if mode == "channel":
        assert q.scale.shape == (2, 200, 1)
    if mode == "block":
        assert q.scale.shape == (2, 2, 3)
    d = fp8.dequantize(q.weight, q.scale, torch.float32)
    rel = ((d - w.float()).abs() / w.float().abs().clamp(min=1e-3)).median().item()
    assert rel < 2**-4  # 3 mantissa bits
    # dequantize -> requantize with the same scale is the identity
    if mode == "tensor":
        again = fp8.quantize_per_tensor(d, scale=q.scale)
        assert torch.equal(again.weight.view(torch.uint8), q.weight.view(torch.uint8))


modelopt_fp8 = pytest.importorskip("modelopt.torch.quantization.qtensor.fp8_tensor")


def test_matches_modelopt_fp8():
    torch.manual_seed(1)
    w = torch.randn(256, 384)  # float32: ModelOpt computes amax/448 in the input dtype
    ref, ref_scale = modelopt_fp8.FP8QTensor.quantize(w)
    ours = fp8.quantize_per_tensor(w)
    assert ours.scale.item() == ref_scale.item()
    assert torch.equal(ref._quantized_data.view(torch.uint8), ours.weight.view(torch.uint8))
    refb, refb_scale = modelopt_fp8.FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    oursb = fp8.quantize_block(w)
    assert torch.equal(refb_scale, oursb.scale)
    assert torch.equal(refb._quantized_data.view(torch.uint8), oursb.weight.view(torch.uint8))


def test_w8a8_per_tensor_rounds_through_the_weights_dtype_as_modelopt():
    """ModelOpt's export divides a BF16 weight by its float32 scale in BF16 (then casts to FP8): the same
    double rounding, by name, with 0-d (ModelOpt) or [1] (compressed-tensors) scalars."""
    w = torch.tensor([[448.0, 1.0, -3.0, 0.0]], dtype=torch.bfloat16)
    got = fp8.w8a8_per_tensor(w, weight_amax=896.0, input_amax=44.8)
    assert got["weight_scale"].item() == 2.0 and got["input_scale"].item() == pytest.approx(0.1)
    assert got["weight"].float().tolist() == [[224.0, 0.5, -1.5, 0.0]] and got["weight_scale"].shape == ()
    ct = fp8.w8a8_per_tensor(w, weight_amax=896.0, input_amax=0.0, scalar_shape=(1,))
    assert ct["input_scale"].tolist() == [1.0] and ct["weight_scale"].shape == (1,)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    s = x.float().abs().amax() / 448
    want = (x / s).to(torch.float8_e4m3fn)  # ModelOpt's expression (quant_utils.to_quantized_weight)
    q = fp8.w8a8_per_tensor(x, weight_amax=x.float().abs().amax(), input_amax=1.0)["weight"]
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
