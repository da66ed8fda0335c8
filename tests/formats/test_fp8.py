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
