"""GPTQ for the routed experts (qtool.ops.quantize.gptq): against llm-compressor 0.14's GPTQ on the same weight,
Hessian and grid; RTN exactly where no error can be compensated; a lower output error than RTN where it can."""

from __future__ import annotations

import pytest
import torch

from qtool.formats import nvfp4
from qtool.ops.quantize import gptq
from qtool.ops.quantize.awq_search import rtn
from qtool.ops.quantize.hessians import ExpertHessians


def _problem(seed: int = 0, rows: int = 64, cols: int = 256, tokens: int = 2048):
    """A weight and the Hessian of correlated inputs with a few outlier channels (where GPTQ differs from RTN)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    mix = torch.eye(cols) + 0.3 * torch.randn(cols, cols, generator=g) / cols**0.5
    x = torch.randn(tokens, cols, generator=g) @ mix
    x[:, :5] *= 10
    return w, x.t() @ x


def _output_error(q: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    d = q.float() - w
    return torch.einsum("rc,cd,rd->", d, h, d).item()


def _nvfp4_grid(w: torch.Tensor):
    ws2 = nvfp4.weight_scale_2_from_amax(nvfp4.matrix_amax(w)).reshape(-1)
    bs = nvfp4.block_scales(w, ws2)
    return bs, ws2


def _llmcompressor_gptq(w, h, scale, global_scale, args):
    quantize_weight = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize").quantize_weight
    zero = torch.zeros(scale.shape, dtype=torch.int8)
    q, _, fell_back = quantize_weight(w.clone(), h.clone(), scale, zero, global_scale, args, 128, 0.01)
    assert not fell_back.any()
    return q


def test_int4_gptq_gives_llmcompressors_weights_exactly():
    """Same weight, Hessian, group scales, damp 0.01 and block 128 as llm-compressor 0.14's `quantize_weight`
    (the GPTQModifier's solver): every quantized weight is the same float. (llm-compressor scales H by 2/N,
    which GPTQ's relative damping makes irrelevant.)"""
    QuantizationArgs = pytest.importorskip("compressed_tensors.quantization").QuantizationArgs
    w, h = _problem()
    q0 = rtn(w[None], 32, torch.bfloat16)
    codes = gptq.solve(w[None], gptq.factor(h[None], damp=0.01), gptq.int4_grid(q0.scales, 32))
    ours = ((codes.float() - 8).unflatten(-1, (-1, 32)) * q0.scales.float()[..., None]).flatten(-2)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    theirs = _llmcompressor_gptq(w[None], h[None] * 2 / 2048, q0.scales.float(), None, args)
    assert torch.equal(ours, theirs)


def test_nvfp4_gptq_gives_llmcompressors_codes():
    """NVFP4 with the same block scales and global scale: every code's magnitude is llm-compressor's, and the
    weights agree to float rounding. Not bit for bit: llm-compressor divides by (block scale / global scale),
    qtool (as ModelOpt's export and qtool's NVFP4 writer) by (block scale * weight_scale_2), an ulp apart;
    and a zero's sign follows the error that rounded to it (both decode to 0)."""
    QuantizationArgs = pytest.importorskip("compressed_tensors.quantization").QuantizationArgs
    w, h = _problem(1)
    bs, ws2 = _nvfp4_grid(w[None])
    codes = gptq.solve(w[None], gptq.factor(h[None], damp=0.01), gptq.nvfp4_grid(bs, ws2))
    args = QuantizationArgs(
        num_bits=4,
        type="float",
        symmetric=True,
        strategy="tensor_group",
        group_size=16,
        scale_dtype=torch.float8_e4m3fn,
    )
    theirs = _llmcompressor_gptq(w[None], h[None], bs.float(), (1 / ws2).reshape(1, 1), args)[0]
    step = (bs.float() * ws2.reshape(-1, 1, 1))[0].repeat_interleave(16, -1)
    assert torch.equal(nvfp4.encode_e2m1(theirs / step) & 7, codes[0] & 7)
    ours = nvfp4.dequantize(nvfp4.pack(codes), bs, ws2, torch.float32)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_below_rtn(act_order):
    w, h = _problem(2)
    bs, ws2 = _nvfp4_grid(w[None])
    fac = gptq.factor(h[None], damp=0.01, act_order=act_order)
    codes = gptq.solve(w[None], fac, gptq.nvfp4_grid(bs, ws2), block_size=32)
    q = nvfp4.dequantize(nvfp4.pack(codes), bs, ws2, torch.float32)[0]
    q_rtn = nvfp4.quantize(w, weight_scale_2=ws2[0]).dequantize(torch.float32)
    assert _output_error(q, w, h) < 0.9 * _output_error(q_rtn, w, h)


@pytest.mark.parametrize("act_order", [False, True])
def test_a_diagonal_hessian_gives_rtns_bytes(act_order):
    """No correlation between inputs: no error can be compensated, and GPTQ's codes are RTN's, byte for byte
    (what an expert without tokens gets: the identity Hessian)."""
    w = torch.randn(3, 32, 64, dtype=torch.bfloat16)
    h = torch.diag_embed(torch.rand(3, 64) + 0.5)
    fac = gptq.factor(h, act_order=act_order)
    bs, ws2 = _nvfp4_grid(w)
    codes = gptq.solve(w, fac, gptq.nvfp4_grid(bs, ws2), block_size=16)
    assert torch.equal(nvfp4.pack(codes), nvfp4.quantize(w, weight_scale_2=ws2).packed)
    q0 = rtn(w, 32, torch.bfloat16)
    codes = gptq.solve(w, fac, gptq.int4_grid(q0.scales, 32), block_size=16)
    assert torch.equal(codes, q0.codes)


def test_experts_are_solved_independently():
    """A stack of experts gives each expert the codes it gets alone (the chunking changes no byte)."""
    pairs = [_problem(s, rows=16, cols=64, tokens=256) for s in range(3)]
    w = torch.stack([p[0] for p in pairs])
    h = torch.stack([p[1] for p in pairs])
    bs, ws2 = _nvfp4_grid(w)
    together = gptq.solve(w, gptq.factor(h), gptq.nvfp4_grid(bs, ws2), block_size=16)
    for k in range(3):
        alone = gptq.solve(
            w[k : k + 1], gptq.factor(h[k : k + 1]), gptq.nvfp4_grid(bs[k : k + 1], ws2[k : k + 1]), block_size=16
        )
        assert torch.equal(together[k], alone[0])


def test_a_hessian_that_cannot_be_factorised_falls_back_to_rtn():
    h = torch.full((1, 16, 16), float("nan"))
    fac = gptq.factor(h)
    assert fac.failed.tolist() == [True]
    w = torch.randn(1, 8, 16)
    bs, ws2 = _nvfp4_grid(w)
    codes = gptq.solve(w, fac, gptq.nvfp4_grid(bs, ws2))
    assert torch.equal(nvfp4.pack(codes), nvfp4.quantize(w, weight_scale_2=ws2).packed)


def test_the_inverse_factor_is_the_cholesky_factor_of_the_damped_inverse():
    """U from one Cholesky of the column-reversed H and a triangular inverse is the upper factor that a
    Cholesky of the damped inverse gives (float64 reference); a Hessian that is not positive definite fails."""
    hs = torch.stack([_problem(seed)[1] for seed in range(3)])
    hs[2] = -hs[2]
    u, failed = gptq.inverse_factor(hs, 0.01)
    assert failed.tolist() == [False, False, True] and torch.equal(u[2], torch.eye(hs.shape[-1]))
    eye = torch.eye(hs.shape[-1], dtype=torch.float64)
    for k in range(2):
        h = hs[k].double()
        damped = h + 0.01 * h.diagonal().mean() * eye
        reference = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
        assert torch.equal(u[k].triu(), u[k])
        assert torch.allclose(u[k].double(), reference, rtol=1e-3, atol=1e-4 * float(reference.abs().max()))


def test_the_hessians_sum_each_experts_routed_rows():
    hess = ExpertHessians()
    x1, x2, mid = torch.randn(5, 8), torch.randn(3, 8), torch.randn(5, 4)
    hess.observe(2, x1.bfloat16(), mid)
    hess.observe(2, x2.bfloat16(), mid)
    got = hess.take(range(1, 3), "gate_up", 8, torch.device("cpu"))
    xs = torch.cat([x1, x2]).bfloat16().float()
    assert torch.equal(got[0], torch.zeros(8, 8))  # expert 1 saw no token
    torch.testing.assert_close(got[1], xs.t() @ xs)
    assert 2 not in hess.gate_up  # dropped once taken


def _updated(method, w, fac, block_size: int = 128):
    """GPTQ codes and block scales of w with `gptq.scales: updated` by criterion `method`."""
    from qtool.ops.quantize.gptq_layer import UpdatedScales

    amax = nvfp4.matrix_amax(w)
    ws2 = nvfp4.weight_scale_2_from_amax(amax).reshape(-1).float()
    chosen = UpdatedScales(method, amax, ws2, ~fac.failed, w.shape[-2], fac.u)
    grid = gptq.nvfp4_grid(torch.ones_like(chosen.block_scale), ws2)
    codes = gptq.solve(w, fac, grid, block_size=block_size, choose=chosen)
    return codes, chosen.block_scale, ws2


@pytest.mark.parametrize("method", ["max", "mse_sweep"])
def test_updated_scales_with_a_diagonal_hessian_give_rtns_bytes(method):
    """No error is compensated, so no block is updated: the scales chosen as GPTQ reaches each block are those
    the same criterion picks before it (max: RTN's; mse_sweep: the sweep's), and the codes RTN's, byte for byte."""
    from qtool.ops.quantize.nvfp4_mse import sweep_block_scales
    from qtool.recipes import WeightScale

    w = torch.randn(3, 32, 64, dtype=torch.bfloat16)
    fac = gptq.factor(torch.diag_embed(torch.rand(3, 64) + 0.5))
    codes, bs, ws2 = _updated(WeightScale(method), w, fac, block_size=32)
    amax = nvfp4.matrix_amax(w)
    want_bs = nvfp4.block_scales(w, ws2) if method == "max" else sweep_block_scales(w, amax)
    want = nvfp4.quantize(w, weight_scale_2=ws2, block_scale=want_bs)
    assert torch.equal(bs.view(torch.uint8), want.block_scale.view(torch.uint8))
    assert torch.equal(nvfp4.pack(codes), want.packed)


@pytest.mark.parametrize("method", ["max", "mse_sweep", "local_hessian"])
def test_updated_scales_lower_the_output_error_below_fixed_scales(method):
    """Scales chosen from the error-updated block fit what GPTQ actually codes: a lower output error than the
    same criterion's scales fixed from the original weights (local_hessian: than mse_sweep's, fixed)."""
    from qtool.ops.quantize.nvfp4_mse import sweep_block_scales
    from qtool.recipes import WeightScale

    w, h = _problem(3)
    w = w[None]
    fac = gptq.factor(h[None], damp=0.01)
    codes, bs, ws2 = _updated(WeightScale(method), w, fac)
    ours = nvfp4.dequantize(nvfp4.pack(codes), bs, ws2, torch.float32)[0]
    fixed_bs = nvfp4.block_scales(w, ws2) if method == "max" else sweep_block_scales(w, nvfp4.matrix_amax(w))
    fixed = gptq.solve(w, fac, gptq.nvfp4_grid(fixed_bs, ws2))
    theirs = nvfp4.dequantize(nvfp4.pack(fixed), fixed_bs, ws2, torch.float32)[0]
    assert ours.isfinite().all() and bs.dtype == torch.float8_e4m3fn and bs.shape == fixed_bs.shape
    gain = {"max": 0.99, "mse_sweep": 0.97, "local_hessian": 0.8}[method]  # measured: 0.98, 0.94, 0.71
    assert _output_error(ours, w[0], h) < gain * _output_error(theirs, w[0], h)


def test_updated_scales_need_whole_groups_in_the_columns_own_order():
    w, h = _problem(4, rows=8, cols=64, tokens=256)
    with pytest.raises(ValueError, match="group start"):
        _updated("max", w[None], gptq.factor(h[None], act_order=True))
    with pytest.raises(ValueError, match="group start"):
        _updated("max", w[None], gptq.factor(h[None]), block_size=24)
