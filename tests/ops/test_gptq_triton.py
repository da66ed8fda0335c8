"""GPTQ's column loop as a Triton kernel (qtool.ops.quantize.gptq_triton): the codes of the torch loop
(gptq.code_group_torch) for NVFP4 and INT4, whole and partial groups, zero columns and E2M1 ties; under
TRITON_INTERPRET on CPU (numpy) and on a GPU, where the whole solver is compared with the CPU's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qtool.formats import nvfp4
from qtool.ops.quantize import gptq, gptq_triton


def _group_case(kind: str, width: int, device: str = "cpu", rows: int = 100, seed: int = 0):
    """(x [3, width, rows], step, u [3, width, width] upper with a positive diagonal, grid): the columns of one
    group in the solver's transposed layout; expert 0's first rows are zero, expert 1's first row sits on
    the E2M1 (or INT4) rounding ties of its steps, expert 2's first rows are zero with a zero step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, width, rows, generator=g) * 0.05
    step = torch.rand(3, width, rows, generator=g) * 0.01 + 0.001
    x[0, :, :3] = 0.0
    x[2, :, :2], step[2, :, :2] = 0.0, 0.0  # an all-zero matrix's step: 0 / 0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75] if kind == gptq.NVFP4 else [0.5, 1.5, -2.5])
    step[1, :, 0] = 2.0**-8
    x[1, :, 0] = ties.repeat(width)[:width] * 2.0**-8
    a = torch.randn(3, width, width, generator=g)
    u = torch.linalg.cholesky(a @ a.transpose(1, 2) + width * torch.eye(width), upper=True)
    x, step, u = x.to(device), step.to(device), u.to(device)
    return x, step, u, gptq.ColumnGrid(kind, step, nvfp4.BLOCK_SIZE if kind == gptq.NVFP4 else 32)


def _both(x, step, u, grid):
    """(codes, errors) of the kernel and of the torch loop."""
    out = []
    for run in (
        lambda c, e: gptq_triton.code_group_triton(x.clone(), step, u, grid.kind == gptq.NVFP4, c, e),
        lambda c, e: gptq.code_group_torch(x.clone(), step, u, grid, c, e),
    ):
        codes, errors = torch.empty(x.shape, dtype=torch.uint8, device=x.device), torch.empty_like(x)
        run(codes, errors)
        out.append((codes, errors))
    return out


def check_kernel_against_torch(device: str) -> None:
    for kind in (gptq.NVFP4, gptq.INT4):
        for width in (16, 5):
            x, step, u, grid = _group_case(kind, width, device)
            (c_kernel, e_kernel), (c_torch, e_torch) = _both(x, step, u, grid)
            assert torch.equal(c_kernel, c_torch), (kind, width, int((c_kernel != c_torch).sum()))
            zero_code = 0 if kind == gptq.NVFP4 else 8  # what the RTN codecs write for a zero weight
            assert bool((c_torch[2, :, :2] == zero_code).all()) and bool((e_torch[2, :, :2] == 0).all())
            # the torch loop's addcmul may fuse its multiply-add: the errors agree to float32 rounding of the
            # updated columns (an error is a difference of nearby values: absolute, not relative, agreement)
            assert float((e_kernel - e_torch).abs().max()) <= 1e-6 * float(e_torch.abs().max()), (kind, width)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter mode)")
def test_interpreter_gives_the_torch_loops_codes():
    code = textwrap.dedent(
        """
        import tests.ops.test_gptq_triton as t
        t.check_kernel_against_torch("cpu")
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_without_the_interpreter_cpu_tensors_take_the_torch_loop(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, step, u, grid = _group_case(gptq.NVFP4, 16)
    assert not gptq_triton.usable(x)
    codes, errors = torch.empty(x.shape, dtype=torch.uint8), torch.empty_like(x)
    gptq.code_group(x.clone(), step, u, grid, codes, errors)
    c_torch, e_torch = torch.empty_like(codes), torch.empty_like(errors)
    gptq.code_group_torch(x.clone(), step, u, grid, c_torch, e_torch)
    assert torch.equal(codes, c_torch) and torch.equal(errors, e_torch)


gpu = pytest.mark.gpu


@gpu
def test_gpu_kernel_gives_the_torch_loops_codes():
    check_kernel_against_torch("cuda")


@gpu
@pytest.mark.parametrize("kind", [gptq.NVFP4, gptq.INT4])
def test_gpu_solver_codes_as_the_cpu_solver(kind):
    """The whole solver (kernel + batched matmuls) on a GPU against the CPU's torch loop, at a real expert's
    column count: the codes agree where float32 rounding of the error updates cannot flip a near-tie."""
    g = torch.Generator().manual_seed(3)
    n_exp, rows, cols = 2, 256, 4096
    w = torch.randn(n_exp, rows, cols, generator=g) * 0.02
    w[:, :, ::512] *= 20
    x = torch.randn(2048, cols, generator=g) * torch.logspace(-1, 1, cols)
    h = (x.T @ x).expand(n_exp, cols, cols).contiguous()
    if kind == gptq.NVFP4:
        ws2 = nvfp4.weight_scale_2_from_amax(nvfp4.matrix_amax(w)).reshape(-1).float()
        grid_of = lambda dev: gptq.nvfp4_grid(nvfp4.block_scales(w.to(dev), ws2.to(dev)), ws2.to(dev))  # noqa: E731
    else:
        scales = (w.reshape(n_exp, rows, -1, 128).abs().amax(-1) / 7).bfloat16()
        grid_of = lambda dev: gptq.int4_grid(scales.to(dev), 128)  # noqa: E731
    on_cpu = gptq.solve(w, gptq.factor(h), grid_of("cpu"))
    on_gpu = gptq.solve(w.cuda(), gptq.factor(h.cuda()), grid_of("cuda")).cpu()
    agree = float((on_cpu == on_gpu).float().mean())
    print(f"{kind}: GPU vs CPU solver codes {agree:.6f} equal")
    assert agree > 0.999


def _chosen(method: str, w: torch.Tensor, fac: gptq.Factor, in_kernel: bool):
    """(codes, block scales) of GPTQ with `gptq.scales: updated` by `method`, the scales chosen inside the
    group kernel or by UpdatedScales' torch calls between the launches."""
    from qtool.ops.quantize.gptq_layer import UpdatedScales
    from qtool.recipes import WeightScale

    amax = nvfp4.matrix_amax(w)
    ws2 = nvfp4.weight_scale_2_from_amax(amax).reshape(-1).float()
    chosen = UpdatedScales(WeightScale(method), amax, ws2, ~fac.failed, w.shape[-2], fac.u)
    assert chosen.kernel_choice is not None
    if not in_kernel:
        chosen.kernel_choice = None
    codes = gptq.solve(w, fac, gptq.nvfp4_grid(torch.ones_like(chosen.block_scale), ws2), choose=chosen)
    return codes, chosen.block_scale.view(torch.uint8)


def check_scales_chosen_in_the_kernel(device: str) -> None:
    """The group kernel's own choice of each block's scale gives the bytes of UpdatedScales' calls: max and
    mse_sweep exactly; local_hessian (the torch search on CPU, its own launch on a GPU) but for near-ties. An
    expert without a usable Hessian (expert 2) takes mse_sweep's scales under local_hessian."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(3, 96, 128, generator=g) * 0.02
    w[:, :, ::32] *= 20  # outlier columns: blocks far below the matrix max
    x = torch.randn(512, 128, generator=g) * torch.logspace(-1, 1, 128)
    h = (x.T @ x).expand(3, 128, 128).contiguous()
    fac = gptq.factor(h.to(device))
    fac.failed[2] = True
    w = w.to(device)
    for method in ("max", "mse_sweep", "local_hessian"):
        (c_in, s_in), (c_out, s_out) = _chosen(method, w, fac, True), _chosen(method, w, fac, False)
        if method == "local_hessian":
            agree = float((s_in == s_out).float().mean())
            print(f"{device} local_hessian: {agree:.6f} of the scales equal")
            assert agree > 0.995
            assert torch.equal(s_in[2], s_out[2])  # the plain sweep's
        else:
            assert torch.equal(s_in, s_out), (method, int((s_in != s_out).sum()))
            assert torch.equal(c_in, c_out), method


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter mode)")
def test_interpreter_scales_chosen_in_the_kernel_are_the_choosers():
    code = "import tests.ops.test_gptq_triton as t; t.check_scales_chosen_in_the_kernel('cpu'); print('ok')"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.splitlines()[-1:] == ["ok"], res.stderr[-3000:]


@gpu
def test_gpu_scales_chosen_in_the_kernel_are_the_choosers():
    check_scales_chosen_in_the_kernel("cuda")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("choose", [0, gptq_triton.CHOOSE_MAX, gptq_triton.CHOOSE_SWEEP, gptq_triton.CHOOSE_HESSIAN])
def test_the_group_kernel_compiles_for_a_hopper_gpu(choose):
    """Each of the group kernel's forms (fixed steps, and each rule that chooses them) becomes sm_90 machine
    code: the interpreter checks what the kernel computes, not that the GPU compiler takes it."""
    from hopper_compile import compile_for_hopper

    kernel = gptq_triton._kernel()
    constexprs = {
        "NVFP4": True,
        "BLOCK_R": gptq_triton.BLOCK_R,
        "W": gptq_triton.GROUP,
        "MAGIC": gptq_triton.ROUND_MAGIC,
        "CHOOSE": choose,
        "NC": 126,
        "SWEEP_BELOW": nvfp4.SWEEP_BELOW,
        "SWEEP_ABOVE": nvfp4.SWEEP_ABOVE,
        "SWEEP_FIRST_HALVABLE": nvfp4.SWEEP_FIRST_HALVABLE,
        "HESSIAN_BELOW": 8,
        "HESSIAN_MARGIN": 1e-3,
    }
    pointers = {"code_ptr": "*u8", "bs_ptr": "*u8", "byte_ptr": "*u8", "plain_ptr": "*u8"}
    compiled = compile_for_hopper(kernel, gptq_triton._group_body, constexprs, pointers)
    assert compiled.asm["cubin"]
