"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", sections 3-4) for a stack of experts at once: each expert's weight W [rows, cols] is coded
column by column, and the rounding error of each column is spread over the columns not yet coded through
the inverse of the expert's Hessian H = sum x x^T of its inputs, so that the expert's OUTPUT error on those
inputs, not its weight error, is what the rounding minimises.

What qtool codes is plain NVFP4 or INT4: the quantization grid of every column (its block or group scale)
is fixed BEFORE the error compensation, from the weights (`ColumnGrid`), and only the codes change; or, with
`choose` (recipe `gptq.scales: updated`, NVFP4), each block's scale is chosen when the column loop reaches
the block, from its error-updated weights (solve's docstring). So the
writer stores the result unchanged (the scales are those RTN or a block-scale search chose), and the
engines load it as any other NVFP4 / compressed-tensors INT4 checkpoint. llm-compressor's GPTQModifier
does the same (its observer's scales, taken from the weights before the loop).

Per expert:
  1. dead columns (H_jj == 0: an input channel never non-zero) get H_jj = 1 and weight 0;
  2. with `act_order`, the columns are coded in descending order of H_jj (each keeps its own block's scale,
     so the stored layout does not change);
  3. damping: H += damp * mean(diag H) * I;
  4. U = upper Cholesky factor of H^-1, from one Cholesky of H in reversed column order and a triangular
     inverse (inverse_factor; a failed factorisation: the expert falls back to RTN);
  5. blocks of `block_size` columns: inside a block each column is coded and its error, divided by U_jj,
     subtracted from the block's later columns (row j of U) -- within a group of 16 columns one by one, from
     group to group in one batched matmul; the block's errors then update every later column in one batched
     matmul (the "lazy batch" update).

Everything is batched over the leading expert dim and runs on the tensors' device: the per-column work is
one Triton launch per 16 columns on a GPU (qtool.ops.quantize.gptq_triton; a few elementwise torch ops per
column elsewhere), the rest batched matmuls, one batched Cholesky and one triangular inverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qtool.formats import nvfp4
from qtool.lazy import lazy_module
from qtool.ops.quantize import gptq_triton

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

NVFP4, INT4 = "nvfp4", "int4"
GROUP = gptq_triton.GROUP  # columns coded per step of the column loop (code_group)


class ColumnGrid:
    """The fixed quantization grid of every column: `step` [E, R, G] the value of one code step of each
    group of `group` columns (NVFP4: float(e4m3 block scale) * weight_scale_2; INT4: the group scale),
    `kind` NVFP4 (E2M1 codes, 16 columns a block) or INT4 (symmetric, codes 0..15 around 8).

    A column is rounded to a bucket (`round`, a few kernels: the column loop's kernel launches are its cost
    on a GPU) and a block of buckets becomes codes at once (`codes`)."""

    def __init__(self, kind: str, step: torch.Tensor, group: int) -> None:
        self.kind, self.step, self.group = kind, step, group
        if kind == NVFP4:
            self.bounds, self.bucket_codes = _e2m1_buckets(step.device)
            self.bucket_values = nvfp4.decode_e2m1(self.bucket_codes)

    def round(self, w: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(buckets, their values) of columns `w` with their steps (same shape): the same division and
        rounding as the RTN codecs (nvfp4.quantize, formats.awq.quantize), so a column that no error
        reached is coded exactly as RTN codes it. NVFP4 buckets are int64 0..15 (`_e2m1_buckets`), INT4
        ones the signed code -8..7 as float."""
        x = w / step
        x = torch.where(x.isnan(), 0.0, x)  # 0 / 0 (an all-zero matrix's step): code 0, as the codecs write it
        if self.kind == NVFP4:
            bucket = torch.bucketize(x, self.bounds, right=True)
            return bucket, self.bucket_values[bucket] * step
        q = torch.round(x).clamp_(-8, 7)
        return q, q * step

    def codes(self, buckets: torch.Tensor) -> torch.Tensor:
        """uint8 codes of a block of buckets (NVFP4: E2M1 codes, the sign in bit 3; INT4: 0..15 around 8)."""
        if self.kind == NVFP4:
            return self.bucket_codes[buckets]
        return (buckets + 8).to(torch.uint8)


def _e2m1_buckets(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds [15], codes uint8 [16]): torch.bucketize(x, bounds, right=True) of a scaled value x is the
    index of its E2M1 code in `codes`, the code nvfp4.encode_e2m1(x) gives. encode_e2m1 rounds |x| up past
    a strict bound b (nvfp4._ROUND_UP_STRICT) when |x| > b and past a tie bound when |x| >= b, and sets the
    sign when x < 0; `right=True` moves x into the next bucket when x >= bound. So, ascending in x: a
    positive strict bound sits one float above b, a positive tie bound at b; a negative strict bound at -b
    (x >= -b: |x| <= b, the smaller magnitude), a negative tie bound one float above -b; and 0 splits the
    signs (-0.0 >= 0: code 0, as encode_e2m1 gives it)."""
    inf = torch.tensor(float("inf"))
    strict = torch.tensor(nvfp4._ROUND_UP_STRICT, dtype=torch.float32)
    tie = torch.tensor(nvfp4._ROUND_UP_AT_TIE, dtype=torch.float32)
    positive = torch.cat([torch.nextafter(strict, inf), tie])
    negative = torch.cat([-strict, torch.nextafter(-tie, inf)])
    bounds = torch.cat([negative, torch.zeros(1), positive]).sort().values
    # each bucket's code: that of a value inside it (its lower bound; below the first: the first minus 1)
    inside = torch.cat([bounds[:1] - 1, bounds])
    return bounds.to(device), nvfp4.encode_e2m1(inside).to(device)


@dataclass
class Factor:
    """What GPTQ needs of a stack of Hessians, computed once for every weight that reads the same inputs
    (gate_proj and up_proj): U [E, C, C] the upper Cholesky factor of the damped inverse Hessian (in coding
    order), `perm` [E, C] the coding order (None: the columns' own), `dead` [E, C] the columns whose input
    was always zero, `failed` [E] the experts whose Hessian could not be factorised (U is the identity
    there: RTN; gptq_layer adds the experts without usable tokens, whose Hessian it set to the identity)."""

    u: torch.Tensor
    perm: torch.Tensor | None
    dead: torch.Tensor
    failed: torch.Tensor


def factor(h: torch.Tensor, *, damp: float = 0.01, act_order: bool = False) -> Factor:
    """Factor Hessians h [E, C, C] (float32; not modified): steps 1-4 of the module docstring."""
    cols = h.shape[-1]
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)  # a view: sets H_jj = 1 in h
    perm = None
    if act_order:
        perm = torch.argsort(h.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
        h = h.gather(-1, perm[:, None, :].expand(-1, cols, -1)).gather(-2, perm[:, :, None].expand(-1, -1, cols))
    u, failed = inverse_factor(h, damp)
    return Factor(u, perm, dead, failed)


FACTOR_EXPERTS = 8  # experts factorised at once: bounds inverse_factor's temporaries (~3 x 0.5 GB at 4096 columns)


def inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, failed): U [E, C, C] the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 per expert;
    `failed` [E] where a factorisation failed (U is then the identity: RTN).

    One Cholesky and one triangular inverse, not a Cholesky, an inverse and a second Cholesky: with J the
    reversal of the columns, J H J = L Lᵀ gives H⁻¹ = (J L⁻ᵀ J)(J L⁻¹ J), and J L⁻¹ J is upper triangular with
    a positive diagonal, so it is U (the factor is unique). FACTOR_EXPERTS at a time, so that the
    temporaries stay small beside the layer's Hessians."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    upper = torch.empty_like(h)
    failed = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
    for e0 in range(0, h.shape[0], FACTOR_EXPERTS):
        part = slice(e0, e0 + FACTOR_EXPERTS)
        damped = h[part] + (damp * h[part].diagonal(dim1=-2, dim2=-1).mean(-1))[:, None, None] * eye
        reversed_h = damped.flip(-2, -1)
        del damped
        lower, info = torch.linalg.cholesky_ex(reversed_h)
        del reversed_h
        inverse = torch.linalg.solve_triangular(lower, eye, upper=False)
        del lower
        upper[part] = inverse.flip(-2, -1)
        del inverse
        failed[part] = (info != 0) | ~upper[part].isfinite().all(-1).all(-1)
    upper[failed] = eye
    return upper, failed


class GroupChooser(Protocol):
    """Chooses each group's step as the column loop reaches it (gptq_layer.UpdatedScales)."""

    # the same choice made inside the group kernel (one launch per group, no torch calls), where the column
    # loop runs on it (gptq_triton.usable); None: `__call__` it is
    kernel_choice: gptq_triton.KernelChoice | None

    def __call__(self, g: int, w: torch.Tensor) -> torch.Tensor:
        """The step [E, R] of group g, from its columns w [E, R, group] as the error compensation has updated
        them."""
        ...


def solve(
    w: torch.Tensor, fac: Factor, grid: ColumnGrid, *, block_size: int = 128, choose: GroupChooser | None = None
) -> torch.Tensor:
    """GPTQ codes (uint8 [E, R, C], columns in their stored order) of w [E, R, C] (any float dtype;
    computed in float32) with the factored Hessians `fac` on the grid `grid` (its step [E, R, C / group]).

    With `choose`, each group's step is not the grid's: it is chosen when the column loop reaches the group's
    first column, from the group's columns as the errors of the columns before have updated them (the
    classic GPTQ "scale at group start"); a group then lies inside one lazy batch (block_size a multiple of
    the group) and the columns keep their order (no act_order), so every update has reached it by then.

    The columns go GROUP (16) at a time through `code_group` (one Triton launch on a GPU), whose errors
    reach the lazy batch's later columns in one batched matmul, and the batch's errors every later column in
    another. Works on the transpose [E, C, R], where a column is contiguous: the column loop reads and writes
    whole rows of memory, not one float in every C."""
    n_exp, rows, cols = w.shape
    dev = w.device
    if choose is not None and (fac.perm is not None or block_size % grid.group or grid.group != GROUP):
        raise ValueError("scales chosen at group start need the columns' own order and whole groups per block")
    w = w.float().masked_fill(fac.dead[:, None, :], 0.0)
    group_of = (torch.arange(cols, device=dev) // grid.group).expand(n_exp, cols)  # column -> stored group
    if fac.perm is not None:
        w = w.gather(-1, fac.perm[:, None, :].expand(-1, rows, -1))
        group_of = group_of.gather(-1, fac.perm)
    wt = w.transpose(1, 2).contiguous()  # [E, C, R]
    del w
    steps = grid.step.transpose(1, 2).gather(1, group_of[:, :, None].expand(-1, -1, rows))  # [E, C, R]
    u = fac.u
    in_kernel = choose.kernel_choice if choose is not None and gptq_triton.usable(wt) else None
    codes = torch.empty((n_exp, cols, rows), dtype=torch.uint8, device=dev)
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        block = wt[:, b0:b1].clone()
        errors = torch.empty_like(block)
        u_block = u[:, b0:b1, b0:b1]
        for g0 in range(0, b1 - b0, GROUP):
            g1 = min(g0 + GROUP, b1 - b0)
            if choose is not None and in_kernel is None:
                step = choose((b0 + g0) // grid.group, block[:, g0:g1].transpose(1, 2))
                steps[:, b0 + g0 : b0 + g1] = step[:, None, :]
            code_group(
                block[:, g0:g1], steps[:, b0 + g0 : b0 + g1], u_block[:, g0:g1, g0:g1], grid,
                codes[:, b0 + g0 : b0 + g1], errors[:, g0:g1], in_kernel, (b0 + g0) // GROUP,
            )  # fmt: skip
            if g1 < b1 - b0:  # the batch's later columns absorb the group's errors (its rows of U)
                block[:, g1:].sub_(torch.bmm(u_block[:, g0:g1, g1:].transpose(1, 2), errors[:, g0:g1]))
        if b1 < cols:
            wt[:, b1:].sub_(torch.bmm(u[:, b0:b1, b1:].transpose(1, 2), errors))
    codes = codes.transpose(1, 2)
    if fac.perm is not None:
        return torch.empty_like(codes).scatter_(-1, fac.perm[:, None, :].expand(-1, rows, -1), codes)
    return codes.contiguous()


def code_group(
    x: torch.Tensor,
    step: torch.Tensor,
    u: torch.Tensor,
    grid: ColumnGrid,
    codes: torch.Tensor,
    errors: torch.Tensor,
    in_kernel: gptq_triton.KernelChoice | None = None,
    group: int = 0,
) -> None:
    """Code the k <= GROUP columns x [E, k, R] (transposed: a column's rows contiguous; modified) on their
    steps [E, k, R], with u [E, k, k] the columns' diagonal block of U: each column rounded to the grid, its
    error (column - value) / U_jj written to errors [E, k, R] and spread over the group's later columns (row j
    of U); the codes go to codes (uint8 [E, k, R]). One Triton launch where it can run (gptq_triton), the same
    operations in torch otherwise. With `in_kernel` (only where the kernel runs) the kernel chooses the
    steps of this group (the matrix's `group`-th) first, as the chooser would."""
    if gptq_triton.usable(x):
        gptq_triton.code_group_triton(x, step, u, grid.kind == NVFP4, codes, errors, in_kernel, group)
    else:
        code_group_torch(x, step, u, grid, codes, errors)


def code_group_torch(
    x: torch.Tensor, step: torch.Tensor, u: torch.Tensor, grid: ColumnGrid, codes: torch.Tensor, errors: torch.Tensor
) -> None:
    """code_group in torch ops, a column at a time."""
    for j in range(x.shape[1]):
        bucket, q = grid.round(x[:, j], step[:, j])
        codes[:, j] = grid.codes(bucket)
        err = errors[:, j]
        torch.div(x[:, j] - q, u[:, j, j, None], out=err)
        x[:, j + 1 :].addcmul_(u[:, j, j + 1 :, None], err[:, None, :], value=-1.0)


def nvfp4_grid(block_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> ColumnGrid:
    """The grid of NVFP4 weights with these block scales (float8_e4m3fn [E, R, C/16]) and per-matrix global
    scales (float32 [E]): the divisor nvfp4.quantize forms, float(block scale) * weight_scale_2."""
    ws2 = weight_scale_2.float().reshape(-1, 1, 1)
    return ColumnGrid(NVFP4, block_scale.float() * ws2, nvfp4.BLOCK_SIZE)


def int4_grid(scales: torch.Tensor, group: int) -> ColumnGrid:
    """The grid of symmetric INT4 weights with these group scales ([E, R, C/group], the stored dtype)."""
    return ColumnGrid(INT4, scales.float(), group)
