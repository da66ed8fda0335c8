"""Triton NVFP4 quantize: bit-for-bit equal to qtool's torch codec and to ModelOpt's
NVFP4QTensor.quantize on the GPU (codes, block scales, weight_scale_2), on random weights and on
chosen values (ties, zero blocks, every E4M3 scale and the midpoints between them, subnormal scales,
saturation, NaN); the dispatcher falls back on CPU without importing triton."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qtool.formats import CodecError, nvfp4
from qtool.formats import nvfp4_triton as nt

gpu = pytest.mark.gpu


def _bits(q: nvfp4.NVFP4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.packed, q.block_scale.view(torch.uint8), q.weight_scale_2.float().view(torch.int32)


def _assert_same(a: nvfp4.NVFP4Weight, b: nvfp4.NVFP4Weight) -> None:
    pa, sa, ga = _bits(a)
    pb, sb, gb = _bits(b)
    assert pa.shape == pb.shape and sa.shape == sb.shape and ga.shape == gb.shape
    n_codes = (nvfp4.unpack(pa) != nvfp4.unpack(pb)).sum().item()
    n_scales = (sa != sb).sum().item()
    assert n_codes == 0 and n_scales == 0 and torch.equal(ga, gb), (n_codes, n_scales)


def _triton(w: torch.Tensor, **kw) -> nvfp4.NVFP4Weight:
    return nt.quantize_fast(w, backend=nt.Backend.TRITON, **kw)


EXACT_WS2 = 2.0**-10  # with this weight_scale_2, 6 * ws2 and amax / (6 * ws2) are exact in float32
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
E2M1_TIE_CODES = [0, 2, 2, 4, 4, 6, 6, 7]  # ties to the even code
E4M3_POS = torch.arange(1, 127, dtype=torch.uint8)  # every positive finite float8_e4m3fn: 2**-9 .. 448


def _chosen_weights(device: str) -> torch.Tensor:
    """[3, 257, 272] float32. Expert 0, first block of rows 0..125: block amax = every positive E4M3
    value * 6 * EXACT_WS2; rows 126..250: the midpoints between neighbouring E4M3 values (RNE ties).
    Expert 1: E2M1 ties (exact under EXACT_WS2: block scale 1.0), a zero block, a -0.0 block. Expert 2:
    a NaN block (its weight_scale_2 is NaN, as torch's amax makes it). Elsewhere randn * 1e-7 .. 1e3 across
    the columns, so amax-derived block scales span subnormal E4M3 up to 448."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(3, 257, 272, generator=g) * torch.logspace(-7, 3, 272)
    e4m3 = E4M3_POS.view(torch.float8_e4m3fn).float()
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    ramp = torch.linspace(-1, 1, 16)  # |endpoints| == 1 exactly: block amax is the chosen value
    w[0, :126, :16] = (e4m3 * 6 * EXACT_WS2)[:, None] * ramp
    w[0, 126:251, :16] = (mids * 6 * EXACT_WS2)[:, None] * ramp
    w[1, 3, 16:32] = 0
    w[1, 4, :16] = torch.tensor(E2M1_TIES * 2) * EXACT_WS2
    w[1, 5, 32:48] = -0.0
    w[2, 6, 48:64] = float("nan")
    return w.to(device)


def _expected_exact_scales() -> torch.Tensor:
    """Scale bytes of the chosen rows under EXACT_WS2: the value itself, a midpoint -> even byte."""
    k = E4M3_POS[:-1].to(torch.int32)
    mids = torch.where(k % 2 == 0, k, k + 1).to(torch.uint8)
    return torch.cat([E4M3_POS, mids])


# ---------------------------------------------------------------- CPU: import contract, fallback


def test_import_does_not_load_triton_and_cpu_falls_back():
    code = textwrap.dedent(
        """
        import sys, torch
        from qtool.formats import nvfp4, nvfp4_triton as nt
        w = (torch.randn(2, 32, 64) * 0.02).bfloat16()
        a, b = nt.quantize_fast(w), nvfp4.quantize(w)
        assert torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8),
                                                               b.block_scale.view(torch.uint8))
        print("triton" in sys.modules, "torch.cuda" in sys.modules and torch.cuda.is_initialized())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_triton_backend_refuses_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CodecError, match="CUDA tensor"):
        nt.quantize_triton(torch.ones(16, 32))
    with pytest.raises(CodecError, match="divisible"):
        nt.quantize_fast(torch.ones(16, 24), backend=nt.Backend.TRITON)


def test_torch_codec_cases_do_not_need_modelopt():
    """Where modelopt is missing (the GPU machine's image), only the cases that compare with ModelOpt
    skip: the Triton-vs-torch-codec cases are still collected and run."""
    code = textwrap.dedent(
        f"""
        import sys, pytest
        sys.modules["modelopt"] = None  # import modelopt raises ImportError, as where it is not installed
        sys.exit(pytest.main([{__file__!r}, "--collect-only", "-q", "-p", "no:cacheprovider"]))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    collected = {line.split("::")[1].split("[")[0] for line in res.stdout.splitlines() if "::" in line}
    torch_codec_cases = {
        "test_random_experts_identical_to_torch_codec",
        "test_chosen_values_identical_to_torch_codec",
        "test_gate_up_shared_scale_and_dispatch",
    }
    assert torch_codec_cases <= collected, res.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter mode)")
def test_interpreter_matches_torch_codec():
    """The kernel logic under TRITON_INTERPRET=1 (numpy, CPU): same bits as the torch codec."""
    code = textwrap.dedent(
        """
        import torch
        from qtool.formats import nvfp4, nvfp4_triton as nt
        import tests.formats.test_nvfp4_triton as t
        w = t._chosen_weights("cpu")
        for kw in ({}, {"global_amax": torch.tensor(0.05)}, {"weight_scale_2": torch.tensor(t.EXACT_WS2)}):
            t._assert_same(nt.quantize_fast(w, backend=nt.Backend.TRITON, **kw), nvfp4.quantize(w, **kw))
        w = (torch.randn(3, 40, 96) * 0.02).bfloat16()
        t._assert_same(nt.quantize_fast(w, backend=nt.Backend.TRITON), nvfp4.quantize(w))
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


# ---------------------------------------------------------------- GPU: bit identity


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_experts_identical_to_torch_codec(dtype):
    torch.manual_seed(0)
    w = (torch.randn(8, 512, 2048, device="cuda") * 0.02).to(dtype)
    _assert_same(_triton(w), nvfp4.quantize(w))
    # ragged tiles: rows and blocks that are not multiples of the tile
    w = (torch.randn(3, 67, 272, device="cuda") * 3).to(dtype)
    _assert_same(_triton(w), nvfp4.quantize(w))
    _assert_same(_triton(w[1]), nvfp4.quantize(w[1]))


@gpu
def test_chosen_values_identical_to_torch_codec():
    w = _chosen_weights("cuda")
    q = _triton(w)
    _assert_same(q, nvfp4.quantize(w))
    # NaN block -> scale 1.0 and codes 0, exactly as the torch codec
    assert q.block_scale[2, 6, 3].float().item() == 1.0 and q.packed[2, 6, 24:32].eq(0).all()
    scales = q.block_scale.view(torch.uint8)
    assert scales.min().item() < 0x08 and scales.max().item() == 0x7E  # subnormal scales .. 448 occur
    # every E4M3 scale, and RNE on exact ties between neighbours
    q = _triton(w, weight_scale_2=torch.tensor(EXACT_WS2))
    _assert_same(q, nvfp4.quantize(w, weight_scale_2=torch.tensor(EXACT_WS2)))
    assert torch.equal(q.block_scale[0, :251, 0].view(torch.uint8).cpu(), _expected_exact_scales())
    assert nvfp4.unpack(q.packed[1, 4, :8]).tolist() == E2M1_TIE_CODES * 2
    for kw in ({"global_amax": torch.tensor(0.05)}, {"weight_scale_2": torch.full((3,), 3e-7)}):
        _assert_same(_triton(w, **kw), nvfp4.quantize(w, **kw))
    zero = torch.zeros(2, 32, 64, device="cuda", dtype=torch.bfloat16)
    _assert_same(_triton(zero), nvfp4.quantize(zero))


@gpu
def test_gate_up_shared_scale_and_dispatch():
    torch.manual_seed(1)
    gate = (torch.randn(4, 256, 512, device="cuda") * 0.02).bfloat16()
    up = (torch.randn(4, 256, 512, device="cuda") * 0.05).bfloat16()
    ws2 = nvfp4.shared_weight_scale_2(gate, up)
    ref_g, ref_u = nvfp4.quantize_gate_up(gate, up)
    _assert_same(nt.quantize_fast(gate, weight_scale_2=ws2), ref_g)
    _assert_same(nt.quantize_fast(up, weight_scale_2=ws2), ref_u)
    assert nt.triton_available()
    # AUTO on a CUDA tensor with a caller block_scale uses the torch codec (same result)
    q = nt.quantize_fast(gate, weight_scale_2=ws2, block_scale=ref_g.block_scale)
    _assert_same(q, ref_g)
    # amax kernel alone
    assert torch.equal(nt.matrix_amax_triton(gate), nvfp4.matrix_amax(gate))


@pytest.fixture
def modelopt_nvfp4():
    """ModelOpt's NVFP4 tensor module; only the cases that compare with ModelOpt need it installed."""
    return pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")


@gpu
@pytest.mark.parametrize("scale", [0.02, 1.0, 300.0])
def test_identical_to_modelopt_per_matrix(modelopt_nvfp4, scale):
    """ModelOpt quantizes one module's weight at a time: amax -> weight_scale_2 on the GPU."""
    NVFP4QTensor = modelopt_nvfp4.NVFP4QTensor
    torch.manual_seed(4)
    w = (torch.randn(4, 1024, 4096, device="cuda") * scale).bfloat16()
    w[0, 3, 16:32] = 0
    w[1, 5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, device="cuda") * scale
    ours = _triton(w)
    for e in range(w.shape[0]):
        qt, s, s2 = NVFP4QTensor.quantize(w[e], 16)
        assert torch.equal(qt._quantized_data, ours.packed[e])
        assert torch.equal(s.view(torch.uint8), ours.block_scale[e].view(torch.uint8))
        assert s2.float().view(torch.int32).item() == ours.weight_scale_2[e].view(torch.int32).item()


@gpu
def test_identical_to_modelopt_batched_and_static_amax(modelopt_nvfp4):
    NVFP4QTensor = modelopt_nvfp4.NVFP4QTensor
    w = _chosen_weights("cuda")
    w = torch.nan_to_num(w, nan=0.0)  # ModelOpt emits NaN scales for NaN blocks; qtool emits 1.0
    ours = _triton(w)
    qt, s, _ = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=ours.weight_scale_2.view(-1, 1, 1))
    assert torch.equal(qt._quantized_data, ours.packed)
    assert torch.equal(s.view(torch.uint8), ours.block_scale.view(torch.uint8))
    amax = torch.tensor(0.05, device="cuda")  # static global amax below the real one: saturation
    ours = _triton(w[1], global_amax=amax)
    qt, s, _ = NVFP4QTensor.quantize(w[1], 16, weights_scaling_factor_2=amax.float() / 2688.0)
    assert torch.equal(qt._quantized_data, ours.packed)
    assert torch.equal(s.view(torch.uint8), ours.block_scale.view(torch.uint8))


def _hopper_cases():
    def sweep(nt):  # the module, passed in: its kernels are made on first use
        c = {"BLOCK_R": 16, "NB": 16, "NC": 126, "PRUNE": True, "BELOW": nvfp4.SWEEP_BELOW, "ABOVE": nvfp4.SWEEP_ABOVE}
        return nt._sweep_kernel(), nt._sweep_body, {**c, "FIRST_HALVABLE": nvfp4.SWEEP_FIRST_HALVABLE, "STEPS": 33}

    def hessian(prune):
        def case(nt):
            c = {"BLOCK_R": 32, "NC": 126, "PRUNE": prune, "BELOW": nt.HESSIAN_BELOW, "MARGIN": nt.HESSIAN_MARGIN}
            return nt._hessian_sweep_kernel(), nt._hessian_sweep_body, c

        return case

    def quantize(nt):
        return nt._kernels()[1], nt._quantize_body, {"BLOCK_R": 16, "NB": 16}

    return {"sweep": sweep, "local_hessian_pruned": hessian(True), "local_hessian_all": hessian(False), "rtn": quantize}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("case", sorted(_hopper_cases()))
def test_the_kernels_compile_for_a_hopper_gpu(case):
    """The block-scale searches and the RTN kernel become sm_90 machine code (the interpreter checks what they
    compute, not that the GPU compiler takes them)."""
    from hopper_compile import compile_for_hopper

    kernel, body, constexprs = _hopper_cases()[case](nt)
    pointers = {"x_ptr": "*bf16", "best_ptr": "*u8", "byte_ptr": "*u8", "packed_ptr": "*u8", "scale_ptr": "*u8"}
    assert compile_for_hopper(kernel, body, constexprs, pointers).asm["cubin"]
