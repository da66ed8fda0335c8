"""GPTQ's inner column loop as one Triton launch per group of 16 columns (qtool.ops.quantize.gptq.code_group).

On a GPU the column loop in torch ops costs ~8 kernel launches per column (round, code, error, update of the
later columns), ~40,000 launches for one 4096-column matrix: the launches, not the arithmetic, set its time.
Here one program holds a tile of rows of the group's 16 columns in registers, for one expert, and codes the
16 columns one after the other exactly as the torch loop does: the column divided by its step (IEEE
division, `div_rn`), rounded to the grid (NVFP4: E2M1 with the codec's tie bounds and sign rule; INT4: round
half to even, clamped to -8..7), its error divided by U_jj, and the group's later columns moved by
err * U[j, later]. It writes the codes (uint8: E2M1 code with the sign in bit 3, or the INT4 code 0..15) and
the errors; the caller applies the errors to the columns after the group (one batched matmul).

Every operation is one correctly rounded float32 operation in the torch loop's order, so under
TRITON_INTERPRET the codes and errors equal the torch loop's (tests/ops/test_gptq_triton.py); on a GPU the
compiler may fuse the update's multiply and subtract, which moves an error by its last bit.

Import contract: as qtool.formats.nvfp4_triton, importing this imports neither triton nor torch.cuda.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from qtool.formats import nvfp4_triton
from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

GROUP = 16  # columns one launch codes (one NVFP4 block)
BLOCK_R = 64  # rows per program
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to the nearest integer, ties to even

tl: Any = None
_e2m1_round: Any = None  # nvfp4_triton's jit helpers, bound by _kernel()
_e2m1_code: Any = None


def _group_body(
    x_ptr,  # [E, >=width, rows] float32: the group's columns, rows contiguous
    step_ptr,  # [E, >=width, rows] float32: each column's grid step per row
    u_ptr,  # [E, >=width, >=width] float32: the group's diagonal block of U
    code_ptr,  # [E, >=width, rows] uint8 out
    err_ptr,  # [E, >=width, rows] float32 out: (column - its value) / U_jj
    rows,
    width,  # columns in this group (<= W)
    x_se,
    x_sc,
    step_se,
    step_sc,
    u_se,
    u_sr,
    u_sc,
    code_se,
    code_sc,
    err_se,
    err_sc,
    NVFP4: tl.constexpr,
    BLOCK_R: tl.constexpr,
    W: tl.constexpr,
    MAGIC: tl.constexpr,
):
    e = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    c = tl.arange(0, W)
    cmask = c < width
    x = tl.load(x_ptr + e * x_se + c[:, None] * x_sc + r[None, :], mask=cmask[:, None] & rmask[None, :], other=0.0)
    # the group's block of U (upper: row j's entries right of the diagonal move the later columns) and its
    # diagonal, held in registers for every column
    u_at = u_ptr + e * u_se + c[:, None] * u_sr + c[None, :] * u_sc
    u_upper = tl.load(u_at, mask=cmask[:, None] & (c[None, :] > c[:, None]) & cmask[None, :], other=0.0)
    u_diag = tl.load(u_ptr + e * u_se + c * (u_sr + u_sc), mask=cmask, other=1.0)
    for j in tl.static_range(W):
        live = rmask & ((r * 0 + j) < width)
        xj = tl.sum(tl.where(c[:, None] == j, x, 0.0), axis=0)  # column j as the earlier columns left it
        step = tl.load(step_ptr + e * step_se + j * step_sc + r, mask=live, other=1.0)
        ujj = tl.sum(tl.where(c == j, u_diag, 0.0), axis=0)
        v = tl.math.div_rn(xj, step)
        v = tl.where(v != v, 0.0, v)  # 0 / 0 (an all-zero matrix's step): code 0, as the codecs write it
        if NVFP4:
            mag = _e2m1_round(tl.abs(v))
            code = _e2m1_code(v)
            q = tl.where(v < 0.0, -mag, mag) * step
        else:
            k = tl.minimum(tl.maximum(v, -8.0), 7.0)
            k = (k + MAGIC) - MAGIC
            code = (k + 8.0).to(tl.int32)
            q = k * step
        err = tl.math.div_rn(xj - q, ujj)
        tl.store(code_ptr + e * code_se + j * code_sc + r, code.to(tl.uint8), mask=live)
        tl.store(err_ptr + e * err_se + j * err_sc + r, err, mask=live)
        u_row = tl.sum(tl.where(c[:, None] == j, u_upper, 0.0), axis=0)  # [W]: U[j, c] for c > j, else 0
        x = x - u_row[:, None] * err[None, :]


@functools.cache
def _kernel() -> Any:
    global tl, _e2m1_round, _e2m1_code
    nvfp4_triton._kernels()  # imports triton, binds its jit helpers and the cache dir
    import triton

    tl = nvfp4_triton.tl
    _e2m1_round, _e2m1_code = nvfp4_triton._e2m1_round, nvfp4_triton._e2m1_code
    return triton.jit(_group_body)


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel can run on tensors like `t`: CUDA with triton (CPU only under TRITON_INTERPRET=1)."""
    if t.is_cuda:
        return nvfp4_triton.triton_available()
    return nvfp4_triton._interpret() and nvfp4_triton.triton_available()


def code_group_triton(
    x: torch.Tensor, step: torch.Tensor, u: torch.Tensor, nvfp4: bool, codes: torch.Tensor, errors: torch.Tensor
) -> None:
    """gptq.code_group in one launch: x [E, k, R] the group's columns (read only), step [E, k, R], u [E, k, k],
    out codes uint8 [E, k, R] and errors float32 [E, k, R]; k <= GROUP, the rows (last dim) of x, step, codes
    and errors contiguous."""
    n_exp, width, rows = x.shape
    for t in (x, step, codes, errors):
        if t.stride(-1) != 1:
            raise ValueError("gptq_triton: the rows of x, step, codes and errors must be contiguous")
    if width > GROUP:
        raise ValueError(f"gptq_triton: {width} columns in one group (at most {GROUP})")
    if not (n_exp and width and rows):
        return
    grid = (-(-rows // BLOCK_R), n_exp)
    _kernel()[grid](
        x,
        step,
        u,
        codes,
        errors,
        rows,
        width,
        x.stride(0),
        x.stride(1),
        step.stride(0),
        step.stride(1),
        u.stride(0),
        u.stride(1),
        u.stride(2),
        codes.stride(0),
        codes.stride(1),
        errors.stride(0),
        errors.stride(1),
        NVFP4=nvfp4,
        BLOCK_R=BLOCK_R,
        W=GROUP,
        MAGIC=ROUND_MAGIC,
        num_warps=4,
    )
