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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.formats import nvfp4, nvfp4_triton
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
_max_scale: Any = None
_sweep_search: Any = None
_hessian_search: Any = None
_choose_step: Any = None  # this module's jit helpers, bound by _kernel()
_block_sweep: Any = None


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
    # with CHOOSE (gptq.scales: updated; the group is one NVFP4 block): the block's scale chosen here
    block,  # the group's block index (column / 16)
    n_blocks,
    bs_ptr,  # [E, rows, n_blocks] uint8 out: the chosen scales' E4M3 bytes
    ws2_ptr,  # [E] float32: weight_scale_2
    gamax_ptr,  # [E] float32: the global amax (mse_sweep)
    values_ptr,  # [NC] float32: the finite positive E4M3 values, ascending
    sweep_ptr,  # [NC] float32: the same / 448 (mse_sweep's candidates)
    byte_ptr,  # [NC] uint8: their E4M3 bytes
    h_ptr,  # [E, n_blocks, 16, 16] float32: each block's Hessian (local_hessian)
    hinv_ptr,  # [E, n_blocks, 16] float32: the diagonals of their inverses (local_hessian)
    plain_ptr,  # [E, n_blocks] uint8: the blocks that take mse_sweep's scale instead (local_hessian)
    NVFP4: tl.constexpr,
    BLOCK_R: tl.constexpr,
    W: tl.constexpr,
    MAGIC: tl.constexpr,
    CHOOSE: tl.constexpr,  # 0: the steps given; else the chooser (KernelChoice.method) chooses them here
    NC: tl.constexpr,
    SWEEP_BELOW: tl.constexpr,
    SWEEP_ABOVE: tl.constexpr,
    SWEEP_FIRST_HALVABLE: tl.constexpr,
    HESSIAN_BELOW: tl.constexpr,
    HESSIAN_MARGIN: tl.constexpr,
):
    e = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    c = tl.arange(0, W)
    cmask = c < width
    x = tl.load(x_ptr + e * x_se + c[:, None] * x_sc + r[None, :], mask=cmask[:, None] & rmask[None, :], other=0.0)
    if CHOOSE != 0:  # the block's scale per row, from its columns before any of them is coded
        chosen_step, chosen_byte = _choose_step(
            tl.trans(x), rmask, e, block, n_blocks, ws2_ptr, gamax_ptr, values_ptr, sweep_ptr, byte_ptr, h_ptr,
            hinv_ptr, plain_ptr, BLOCK_R, CHOOSE, NC, SWEEP_BELOW, SWEEP_ABOVE, SWEEP_FIRST_HALVABLE,
            HESSIAN_BELOW, HESSIAN_MARGIN,
        )  # fmt: skip
        tl.store(bs_ptr + (e * rows + r) * n_blocks + block, chosen_byte.to(tl.uint8), mask=rmask)
    # the group's block of U (upper: row j's entries right of the diagonal move the later columns) and its
    # diagonal, held in registers for every column
    u_at = u_ptr + e * u_se + c[:, None] * u_sr + c[None, :] * u_sc
    u_upper = tl.load(u_at, mask=cmask[:, None] & (c[None, :] > c[:, None]) & cmask[None, :], other=0.0)
    u_diag = tl.load(u_ptr + e * u_se + c * (u_sr + u_sc), mask=cmask, other=1.0)
    for j in tl.static_range(W):
        live = rmask & ((r * 0 + j) < width)
        xj = tl.sum(tl.where(c[:, None] == j, x, 0.0), axis=0)  # column j as the earlier columns left it
        if CHOOSE != 0:  # noqa: SIM108 (a constexpr branch: chosen_step exists only there)
            step = chosen_step
        else:
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


def _choose_step_body(
    xt,  # [R, 16] float32: the block's 16 columns as the errors before have updated them, a row per row
    rmask,
    e,
    block,
    n_blocks,
    ws2_ptr,
    gamax_ptr,
    values_ptr,
    sweep_ptr,
    byte_ptr,
    h_ptr,
    hinv_ptr,
    plain_ptr,
    BLOCK_R: tl.constexpr,
    CHOOSE: tl.constexpr,
    NC: tl.constexpr,
    SWEEP_BELOW: tl.constexpr,
    SWEEP_ABOVE: tl.constexpr,
    SWEEP_FIRST_HALVABLE: tl.constexpr,
    HESSIAN_BELOW: tl.constexpr,
    HESSIAN_MARGIN: tl.constexpr,
):
    # Each row's scale of the block by the chooser's rule (CHOOSE 1: max, 2: mse_sweep, 3: local_hessian,
    # whose `plain` blocks take mse_sweep's), with the helpers of the one-launch searches
    # (qtool.formats.nvfp4_triton), so the bytes are those of gptq_layer.UpdatedScales' torch calls.
    # Returns (the step float(scale) * ws2 [R], the scale's E4M3 byte [R]).
    ws2 = tl.load(ws2_ptr + e)
    if CHOOSE == 1:
        scale, byte = _max_scale(tl.max(tl.abs(xt), axis=1), ws2)
    else:
        if CHOOSE == 2:
            k = _block_sweep(xt, gamax_ptr, e, sweep_ptr, BLOCK_R, NC, SWEEP_BELOW, SWEEP_ABOVE, SWEEP_FIRST_HALVABLE)
        else:
            if tl.load(plain_ptr + e * n_blocks + block) != 0:
                k = _block_sweep(
                    xt, gamax_ptr, e, sweep_ptr, BLOCK_R, NC, SWEEP_BELOW, SWEEP_ABOVE, SWEEP_FIRST_HALVABLE
                )
            else:
                e16 = tl.arange(0, 16)
                at = e * n_blocks + block
                h = tl.load(h_ptr + at * 256 + e16[:, None] * 16 + e16[None, :])
                hinv = tl.load(hinv_ptr + at * 16 + e16)
                k = _hessian_search(
                    xt, rmask, h, hinv, ws2, values_ptr, BLOCK_R, NC, True, HESSIAN_BELOW, HESSIAN_MARGIN
                )
        scale = tl.load(values_ptr + k)
        byte = tl.load(byte_ptr + k).to(tl.int32)
    return scale * ws2, byte


def _block_sweep_body(
    xt,
    gamax_ptr,
    e,
    sweep_ptr,
    BLOCK_R: tl.constexpr,
    NC: tl.constexpr,
    SWEEP_BELOW: tl.constexpr,
    SWEEP_ABOVE: tl.constexpr,
    SWEEP_FIRST_HALVABLE: tl.constexpr,
):
    # mse_sweep's candidate index [R] for one block of R rows (the windowed sweep, one block per row)
    ga = tl.zeros([BLOCK_R], dtype=tl.float32) + tl.load(gamax_ptr + e)
    k = _sweep_search(
        tl.expand_dims(tl.abs(xt), 1), ga, sweep_ptr, BLOCK_R, 1, NC, True, SWEEP_BELOW, SWEEP_ABOVE,
        SWEEP_FIRST_HALVABLE, SWEEP_BELOW + SWEEP_ABOVE,
    )  # fmt: skip
    return tl.sum(k, axis=1)  # [R, 1] -> [R]


@functools.cache
def _kernel() -> Any:
    global tl, _e2m1_round, _e2m1_code, _max_scale, _sweep_search, _hessian_search, _choose_step, _block_sweep
    nvfp4_triton._kernels()  # imports triton, binds its jit helpers and the cache dir
    import triton

    tl = nvfp4_triton.tl
    _e2m1_round, _e2m1_code = nvfp4_triton._e2m1_round, nvfp4_triton._e2m1_code
    _max_scale, _sweep_search = nvfp4_triton._max_scale, nvfp4_triton._sweep_search
    _hessian_search = nvfp4_triton._hessian_search
    _choose_step = triton.jit(_choose_step_body)
    _block_sweep = triton.jit(_block_sweep_body)
    return triton.jit(_group_body)


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel can run on tensors like `t`: CUDA with triton (CPU only under TRITON_INTERPRET=1)."""
    if t.is_cuda:
        return nvfp4_triton.triton_available()
    return nvfp4_triton._interpret() and nvfp4_triton.triton_available()


# KernelChoice.method: the rule the group kernel chooses each block's scale by (gptq.scales: updated)
CHOOSE_MAX, CHOOSE_SWEEP, CHOOSE_HESSIAN = 1, 2, 3


@dataclass
class KernelChoice:
    """What the group kernel needs to choose each block's scale itself, rather than take the steps it is
    given (gptq.scales: updated; made once per matrix by gptq_layer.UpdatedScales): `method` (CHOOSE_*), the
    block scales it fills (uint8 [E, rows, n_blocks], contiguous), weight_scale_2 and the global amax
    (float32 [E]); for CHOOSE_HESSIAN each block's Hessian (float32 [E, n_blocks, 16, 16]), the diagonals
    of their inverses ([E, n_blocks, 16]: nvfp4_triton.hessian_inverse_diagonals) and the blocks that take
    mse_sweep's scale instead (uint8 [E, n_blocks])."""

    method: int
    block_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    global_amax: torch.Tensor
    hessian: torch.Tensor | None = None
    inverse_diagonal: torch.Tensor | None = None
    plain: torch.Tensor | None = None

    def __post_init__(self) -> None:
        dev = self.block_scale.device
        self.scale_bytes = nvfp4.fp8_scale_bytes(dev)
        self.values = self.scale_bytes.view(torch.float8_e4m3fn).float().contiguous()
        self.sweep_candidates = (self.values / nvfp4.E4M3_MAX).contiguous()  # as sweep_block_scales_triton


def code_group_triton(
    x: torch.Tensor,
    step: torch.Tensor,
    u: torch.Tensor,
    nvfp4_grid: bool,
    codes: torch.Tensor,
    errors: torch.Tensor,
    choice: KernelChoice | None = None,
    block: int = 0,
) -> None:
    """gptq.code_group in one launch: x [E, k, R] the group's columns (read only), step [E, k, R], u [E, k, k],
    out codes uint8 [E, k, R] and errors float32 [E, k, R]; k <= GROUP, the rows (last dim) of x, step, codes
    and errors contiguous. With `choice`, the group is NVFP4 block `block` of the matrix, whose scale the
    kernel chooses per row (and stores in choice.block_scale) before it codes the first column; `step` is
    then not read."""
    n_exp, width, rows = x.shape
    for t in (x, step, codes, errors):
        if t.stride(-1) != 1:
            raise ValueError("gptq_triton: the rows of x, step, codes and errors must be contiguous")
    if width > GROUP:
        raise ValueError(f"gptq_triton: {width} columns in one group (at most {GROUP})")
    if not (n_exp and width and rows):
        return
    tensors: tuple[torch.Tensor, ...]
    if choice is None:
        n_blocks, tensors, method = 1, (x,) * 9, 0
    else:
        n_blocks, method = choice.block_scale.shape[-1], choice.method
        unused = choice.weight_scale_2  # a pointer the kernel does not read for this method
        tensors = (
            choice.block_scale.view(torch.uint8),
            choice.weight_scale_2,
            choice.global_amax,
            choice.values,
            choice.sweep_candidates,
            choice.scale_bytes,
            unused if choice.hessian is None else choice.hessian,
            unused if choice.inverse_diagonal is None else choice.inverse_diagonal,
            unused if choice.plain is None else choice.plain,
        )
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
        block,
        n_blocks,
        *tensors,
        NVFP4=nvfp4_grid,
        BLOCK_R=BLOCK_R,
        W=GROUP,
        MAGIC=ROUND_MAGIC,
        CHOOSE=method,
        NC=126,
        SWEEP_BELOW=nvfp4.SWEEP_BELOW,
        SWEEP_ABOVE=nvfp4.SWEEP_ABOVE,
        SWEEP_FIRST_HALVABLE=nvfp4.SWEEP_FIRST_HALVABLE,
        HESSIAN_BELOW=nvfp4_triton.HESSIAN_BELOW,
        HESSIAN_MARGIN=nvfp4_triton.HESSIAN_MARGIN,
        num_warps=4,
    )
