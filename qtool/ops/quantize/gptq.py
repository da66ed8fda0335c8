"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", sections 3-4) for a stack of experts at once: each expert's weight W [rows, cols] is coded
column by column, and the rounding error of each column is spread over the columns not yet coded through
the inverse of the expert's Hessian H = sum x x^T of its inputs, so that the expert's OUTPUT error on those
inputs, not its weight error, is what the rounding minimises.

What qtool codes is plain NVFP4 or INT4: the quantization grid of every column (its block or group scale)
is fixed BEFORE the error compensation, from the weights (`ColumnGrid`), and only the codes change. So the
writer stores the result unchanged (the scales are those RTN or a block-scale search chose), and the
engines load it as any other NVFP4 / compressed-tensors INT4 checkpoint. llm-compressor's GPTQModifier
does the same (its observer's scales, taken from the weights before the loop).

Per expert:
  1. dead columns (H_jj == 0: an input channel never non-zero) get H_jj = 1 and weight 0;
  2. with `act_order`, the columns are coded in descending order of H_jj (each keeps its own block's scale,
     so the stored layout does not change);
  3. damping: H += damp * mean(diag H) * I;
  4. U = upper Cholesky factor of H^-1 (a failed factorisation: the expert falls back to RTN);
  5. blocks of `block_size` columns: inside a block each column is coded and its error, divided by U_jj,
     subtracted from the block's later columns (row j of U); the block's errors then update every later
     column in one batched matmul (the "lazy batch" update).

Everything is batched over the leading expert dim and runs on the tensors' device: the per-column work is
a few elementwise ops on [experts, rows], the rest batched matmuls and one batched Cholesky.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.formats import nvfp4

NVFP4, INT4 = "nvfp4", "int4"


class ColumnGrid:
    """The fixed quantization grid of every column: `step` [E, R, G] the value of one code step of each
    group of `group` columns (NVFP4: float(e4m3 block scale) * weight_scale_2; INT4: the group scale),
    `kind` NVFP4 (E2M1 codes, 16 columns a block) or INT4 (symmetric, codes 0..15 around 8)."""

    def __init__(self, kind: str, step: torch.Tensor, group: int) -> None:
        self.kind, self.step, self.group = kind, step, group
        dev = step.device
        # E2M1 rounding as one bucketize (the column loop's kernels are its cost on a GPU): a magnitude's
        # code is the number of rounding bounds at or below it, a strict bound (nvfp4._ROUND_UP_STRICT)
        # moved one float up so that "at or below" means "strictly below" there
        strict = torch.tensor(nvfp4._ROUND_UP_STRICT, dtype=torch.float32)
        bounds = torch.cat([torch.nextafter(strict, torch.tensor(float("inf"))), torch.tensor(nvfp4._ROUND_UP_AT_TIE)])
        self.bounds = bounds.sort().values.to(dev)
        self.values = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float32, device=dev)

    def code(self, w: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes uint8, their values) of columns `w` [E, R] with their steps [E, R]: the same division
        and rounding as the RTN codecs (nvfp4.quantize, formats.awq.quantize), so a column that no error
        reached is coded exactly as RTN codes it."""
        x = w / step
        if self.kind == NVFP4:
            codes = torch.bucketize(x.abs(), self.bounds, right=True).to(torch.uint8)
            codes |= (x < 0).to(torch.uint8) << 3  # the sign as nvfp4.encode_e2m1 sets it
            return codes, self.values[codes.long()] * step
        q = torch.round(x).clamp_(-8, 7)
        return (q + 8).to(torch.uint8), q * step


@dataclass
class Factor:
    """What GPTQ needs of a stack of Hessians, computed once for every weight that reads the same inputs
    (gate_proj and up_proj): U [E, C, C] the upper Cholesky factor of the damped inverse Hessian (in coding
    order), `perm` [E, C] the coding order (None: the columns' own), `dead` [E, C] the columns whose input
    was always zero, `failed` [E] the experts whose Hessian could not be factorised (U is the identity
    there: RTN)."""

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


def inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, failed): U [E, C, C] the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 per expert;
    `failed` [E] where a factorisation failed (U is then the identity: RTN)."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    h = h + (damp * h.diagonal(dim1=-2, dim2=-1).mean(-1))[:, None, None] * eye
    lower, info = torch.linalg.cholesky_ex(h)
    del h
    inv = torch.cholesky_inverse(lower)
    del lower
    upper, info2 = torch.linalg.cholesky_ex(inv, upper=True)
    failed = (info != 0) | (info2 != 0) | ~upper.isfinite().all(-1).all(-1)
    return torch.where(failed[:, None, None], eye, upper), failed


def solve(w: torch.Tensor, fac: Factor, grid: ColumnGrid, *, block_size: int = 128) -> torch.Tensor:
    """GPTQ codes (uint8 [E, R, C], columns in their stored order) of w [E, R, C] (any float dtype;
    computed in float32) with the factored Hessians `fac` on the grid `grid` (its step [E, R, C / group])."""
    n_exp, rows, cols = w.shape
    dev = w.device
    w = w.float().masked_fill(fac.dead[:, None, :], 0.0)
    group_of = (torch.arange(cols, device=dev) // grid.group).expand(n_exp, cols)  # column -> stored group
    if fac.perm is not None:
        w = w.gather(-1, fac.perm[:, None, :].expand(-1, rows, -1))
        group_of = group_of.gather(-1, fac.perm)
    u = fac.u
    codes = torch.empty((n_exp, rows, cols), dtype=torch.uint8, device=dev)
    steps = grid.step.gather(-1, group_of[:, None, :].expand(-1, rows, -1))  # [E, R, C]: each column's step
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        block = w[:, :, b0:b1].clone()
        errors = torch.empty_like(block)
        u_block = u[:, b0:b1, b0:b1]
        for j in range(b1 - b0):
            col_codes, q = grid.code(block[:, :, j], steps[:, :, b0 + j])
            codes[:, :, b0 + j] = col_codes
            err = (block[:, :, j] - q) / u_block[:, j, j, None]
            errors[:, :, j] = err
            # the block's later columns absorb this column's error (row j of U)
            block[:, :, j + 1 :].sub_(err[:, :, None] * u_block[:, None, j, j + 1 :])
        if b1 < cols:
            w[:, :, b1:].sub_(torch.bmm(errors, u[:, b0:b1, b1:]))
    if fac.perm is not None:
        codes = torch.empty_like(codes).scatter_(-1, fac.perm[:, None, :].expand(-1, rows, -1), codes)
    return codes


def nvfp4_grid(block_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> ColumnGrid:
    """The grid of NVFP4 weights with these block scales (float8_e4m3fn [E, R, C/16]) and per-matrix global
    scales (float32 [E]): the divisor nvfp4.quantize forms, float(block scale) * weight_scale_2."""
    ws2 = weight_scale_2.float().reshape(-1, 1, 1)
    return ColumnGrid(NVFP4, block_scale.float() * ws2, nvfp4.BLOCK_SIZE)


def int4_grid(scales: torch.Tensor, group: int) -> ColumnGrid:
    """The grid of symmetric INT4 weights with these group scales ([E, R, C/group], the stored dtype)."""
    return ColumnGrid(INT4, scales.float(), group)
