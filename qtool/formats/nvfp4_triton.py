"""Fused NVFP4 RTN quantize as Triton kernels, bit-identical to `qtool.formats.nvfp4.quantize` (and
so to ModelOpt's `NVFP4QTensor.quantize`), plus the `quantize_fast` dispatcher.

Two launches per call for a [*lead, out, in] weight (R = prod(lead) * out rows):

1. `_amax_kernel`, grid (matrices, splits): each program reduces max|w| over one slice of one matrix
   into a partial; `torch.amax` over the partials and `weight_scale_2_from_amax` (the same torch op as
   the reference codec, on the same device) give weight_scale_2. Skipped when the caller passes
   weight_scale_2 / global_amax. No atomics: the result does not depend on scheduling.
2. `_quantize_kernel`, grid (row tiles, column tiles): loads a [BLOCK_R, NB, 16] tile of whole
   16-element blocks once, and in registers computes the block amax, the block scale
   fl(amax / fl(6 * ws2)), its zero/NaN -> 1.0 and [2**-9, 448] clamp, its round-to-nearest-even to
   FP8 E4M3 (done on the float32 bits, so no FP8 conversion instruction or interpreter support is
   relied on), the divisor fl(float(e4m3) * ws2), the codes of fl(w / divisor) with the E2M1 ties-to-
   even bounds, and packs element pairs (even element in the low nibble). It writes the packed bytes
   and the scale bytes; nothing else touches memory.

Exactness notes. Every division uses `tl.math.div_rn` (IEEE round-to-nearest): Triton's plain `/` on
float32 lowers to the approximate `div.full.f32` on NVIDIA GPUs and would differ from torch in the last
bit. The operation order is the reference's (ModelOpt nvfp4_tensor.py `get_weights_scaling_factor`,
`quantize`, `_cast_fp4`; qtool/formats/nvfp4.py); each step is a single correctly-rounded float32
operation, so the results are the same bits on any IEEE device. weight_scale_2 is computed by torch
rather than in the kernel because torch's CUDA `tensor / python_scalar` multiplies by the float32
reciprocal (aten BinaryDivTrueKernel.cu), which ModelOpt's `get_weights_scaling_factor_2` inherits;
using the same torch op keeps that bit as well. NaN anywhere in a block makes that block's amax NaN, as
torch.maximum does in the reference.

Import contract: importing this module imports neither triton nor torch.cuda. Triton is imported on
the first kernel call only (`_kernels()`), and `quantize_fast` asks for it only for CUDA tensors (or
when TRITON_INTERPRET=1 and the TRITON backend is asked for explicitly).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.cache import cache_dir
from qtool.formats import CodecError, nvfp4
from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

BLOCK_SIZE = nvfp4.BLOCK_SIZE


class Backend(enum.Enum):
    """Which implementation `quantize_fast` runs."""

    AUTO = "auto"  # Triton for CUDA tensors when triton imports, else the torch codec
    TRITON = "triton"  # the Triton kernels (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1)
    TORCH = "torch"  # qtool.formats.nvfp4.quantize


@dataclass(frozen=True)
class TileConfig:
    """Tile of the quantize kernel: block_rows rows x blocks_per_tile 16-element blocks."""

    block_rows: int = 16
    blocks_per_tile: int = 16
    num_warps: int = 4
    amax_block: int = 4096  # elements per step of the amax kernel
    amax_splits: int = 32  # programs per matrix of the amax kernel (fewer for small matrices)


DEFAULT_TILE = TileConfig()


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def triton_available() -> bool:
    """True when triton can be imported (checked once; imports triton only if it is installed)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        _kernels()
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- kernel bodies (plain Python until
# `_kernels()` wraps them with triton.jit; `tl` is bound at module level by that call, so nothing here
# needs triton at import time; annotations stay strings thanks to `from __future__ import annotations`).

tl: Any = None
_e4m3_rne: Any = None  # triton.jit(_e4m3_rne_body), bound with `tl`
_e2m1_round: Any = None  # triton.jit(_e2m1_round_body), bound with `tl`
_e2m1_code: Any = None  # triton.jit(_e2m1_code_body), bound with `tl`
_block_tile: Any = None  # triton.jit(_block_tile_body), bound with `tl`
_hessian_loss: Any = None  # triton.jit(_hessian_loss_body), bound with `tl`
_hessian_search: Any = None  # triton.jit(_hessian_search_body), bound with `tl`
_sweep_search: Any = None  # triton.jit(_sweep_search_body), bound with `tl`
_max_scale: Any = None  # triton.jit(_max_scale_body), bound with `tl`


def _amax_body(x_ptr, part_ptr, numel_per_mat, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    mat = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    base = mat.to(tl.int64) * numel_per_mat
    start = sp.to(tl.int64) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(STEPS):
        idx = start + step * BLOCK + tl.arange(0, BLOCK)
        m = idx < numel_per_mat
        v = tl.abs(tl.load(x_ptr + base + idx, mask=m, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, v)
        nan = nan | (v != v).to(tl.int32)  # noqa: PLR0124 (NaN test)
    res = tl.max(acc, axis=0)
    res = tl.where(tl.max(nan, axis=0) > 0, float("nan"), res)
    tl.store(part_ptr + mat * nsplit + sp, res)


def _e4m3_rne_body(s):
    # round-to-nearest-even to E4M3 on the float32 bits of s (positive, finite, in [2**-9, 448]): keep 3
    # mantissa bits for normals (exp >= -6), fewer below so the quantum is 2**-9 (E4M3 subnormals).
    # Returns (the rounded value as float32, its E4M3 byte as int32).
    bits = s.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    drop = 20 + tl.minimum(tl.maximum(-6 - exp, 0), 3)
    # lowest kept bit of the significand with its implicit leading 1 (for drop == 23 that 1 is all
    # that is kept: 1.5 * 2**-9 must round to 2 * 2**-9, the even multiple of the quantum)
    lsb = (((bits & 0x7FFFFF) | 0x800000) >> drop) & 1
    rb = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    sq = rb.to(tl.float32, bitcast=True)  # exactly representable in E4M3, <= 448
    rexp = (rb >> 23) - 127
    normal_byte = ((rexp + 7) << 3) | ((rb >> 20) & 7)
    sub_byte = (sq * 512.0).to(tl.int32)  # exact: sq is k * 2**-9, k in 1..7
    return sq, tl.where(rexp >= -6, normal_byte, sub_byte)


def _max_scale_body(bamax, ws2):
    # RTN's block scale from the block amax: fl(amax / fl(6 * ws2)), an all-zero block's 0 (or an all-zero
    # matrix's NaN) -> 1.0, clamped to [2**-9, 448], rounded to E4M3 (nvfp4._scales_from_block_amax).
    # Returns (the scale as float32, its E4M3 byte as int32).
    s = tl.math.div_rn(bamax, 6.0 * ws2)
    s = tl.where((s == 0.0) | (s != s), 1.0, s)  # noqa: PLR0124 (NaN test)
    s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)  # clamp(2**-9, 448)
    return _e4m3_rne(s)


def _e2m1_round_body(a):
    # |x| already divided by its scale -> the nearest E2M1 magnitude, ties to the even code (the bounds of
    # nvfp4.encode_e2m1: strict at 0.25, 1.25, 2.5, 5; inclusive at 0.75, 1.75, 3.5)
    return tl.where(
        a <= 0.25,
        0.0,
        tl.where(
            a < 0.75,
            0.5,
            tl.where(
                a <= 1.25,
                1.0,
                tl.where(a < 1.75, 1.5, tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, 6.0)))),
            ),
        ),
    )


def _e2m1_code_body(v):
    # a value already divided by its scale -> its E2M1 code (int32): the magnitude's index with the codec's
    # bounds (strict at 0.25, 1.25, 2.5, 5; inclusive at 0.75, 1.75, 3.5), the sign in bit 3 where v < 0
    a = tl.abs(v)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | ((v < 0.0).to(tl.int32) << 3)


def _block_tile_body(x_ptr, n_rows, n_blocks, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    # The tile of a [rows, n_blocks * 16] weight that program (row tile, block tile) works on: its rows [R]
    # (int64: offsets past 2**31), its blocks [NB], the row mask [R], the tile mask [R, NB] and the tile's
    # values as float32 [R, NB, 16] (0 where masked).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    blks = tl.program_id(1) * NB + tl.arange(0, NB)
    rmask = rows < n_rows
    m2 = rmask[:, None] & (blks < n_blocks)[None, :]
    e16 = tl.arange(0, 16)
    offs = rows[:, None, None] * (n_blocks * 16) + blks[None, :, None] * 16 + e16[None, None, :]
    x = tl.load(x_ptr + offs, mask=m2[:, :, None], other=0.0).to(tl.float32)
    return rows, blks, rmask, m2, x


def _quantize_body(
    x_ptr,
    ws2_ptr,
    packed_ptr,
    scale_ptr,
    n_rows,
    n_blocks,  # 16-element blocks per row (in / 16)
    rows_per_mat,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
):
    rows, blks, rmask, m2, x = _block_tile(x_ptr, n_rows, n_blocks, BLOCK_R, NB)  # x [R, NB, 16]
    ws2 = tl.load(ws2_ptr + rows // rows_per_mat, mask=rmask, other=1.0)  # [R] float32

    # block amax (NaN-propagating like torch.maximum) -> its E4M3 scale
    ax = tl.abs(x)
    bamax = tl.max(ax, axis=2)
    has_nan = tl.max((x != x).to(tl.int32), axis=2)  # noqa: PLR0124 (NaN test)
    bamax = tl.where(has_nan > 0, float("nan"), bamax)
    sq, sbyte = _max_scale(bamax, ws2[:, None])  # exactly representable in E4M3, <= 448
    tl.store(scale_ptr + rows[:, None] * n_blocks + blks[None, :], sbyte.to(tl.uint8), mask=m2)

    # codes of fl(x / fl(scale * ws2)); E2M1 bounds with ties to the even code
    denom = sq * ws2[:, None]  # [R, NB]
    code = _e2m1_code(tl.math.div_rn(x, denom[:, :, None]))

    # pack pairs: even element low nibble
    lo, hi = tl.split(tl.reshape(code, (BLOCK_R, NB, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)  # [R, NB, 8]
    e8 = tl.arange(0, 8)
    poffs = rows[:, None, None] * (n_blocks * 8) + blks[None, :, None] * 8 + e8[None, None, :]
    tl.store(packed_ptr + poffs, packed, mask=m2[:, :, None])


def _sweep_body(
    x_ptr,
    amax_ptr,  # [matrices] float32: the per-matrix amax the global scale comes from
    cand_ptr,  # [NC] float32: the finite positive E4M3 values / 448, ascending
    byte_ptr,  # [NC] uint8: the same values' E4M3 bytes
    best_ptr,  # [rows, n_blocks] uint8 out: the chosen block scale's byte
    n_rows,
    n_blocks,
    rows_per_mat,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
    NC: tl.constexpr,
    PRUNE: tl.constexpr,  # try only each block's window of candidates (nvfp4.sweep_window), else all NC
    BELOW: tl.constexpr,  # nvfp4.SWEEP_BELOW
    ABOVE: tl.constexpr,  # nvfp4.SWEEP_ABOVE
    FIRST_HALVABLE: tl.constexpr,  # nvfp4.SWEEP_FIRST_HALVABLE
    STEPS: tl.constexpr,  # candidates each block tries: BELOW + ABOVE with PRUNE, else NC
):
    # The per-block FP8 scale sweep (qtool.ops.quantize.nvfp4_mse): every candidate c scales the block by
    # c * amax / 6, written as ModelOpt's sweep kernel writes it (kernels/quantization/gemm/
    # nvfp4_fp8_sweep.py), so both compile to the same float32 operations; the first smallest loss wins.
    # With PRUNE each block tries SWEEP_WINDOW candidates from its own first one (k = start + j, ascending,
    # so the first-smallest rule is unchanged); the candidates left out can never be that first smallest
    # (the proof is at nvfp4.sweep_window). Every program runs the same number of steps.
    rows, blks, rmask, m2, x = _block_tile(x_ptr, n_rows, n_blocks, BLOCK_R, NB)
    ga = tl.load(amax_ptr + rows // rows_per_mat, mask=rmask, other=0.0)
    best_k = _sweep_search(tl.abs(x), ga, cand_ptr, BLOCK_R, NB, NC, PRUNE, BELOW, ABOVE, FIRST_HALVABLE, STEPS)
    byte = tl.load(byte_ptr + best_k)
    tl.store(best_ptr + rows[:, None] * n_blocks + blks[None, :], byte, mask=m2)


def _sweep_search_body(
    x,  # [R, NB, 16] float32: |w| of R rows of NB blocks
    ga,  # [R] float32: each row's matrix amax
    cand_ptr,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
    NC: tl.constexpr,
    PRUNE: tl.constexpr,
    BELOW: tl.constexpr,
    ABOVE: tl.constexpr,
    FIRST_HALVABLE: tl.constexpr,
    STEPS: tl.constexpr,
):
    # _sweep_body's search (also GPTQ's group kernel's, qtool.ops.quantize.gptq_triton): the index [R, NB] of
    # each block's first best candidate
    best_loss = tl.full([BLOCK_R, NB], float("inf"), dtype=tl.float32)
    best_k = tl.zeros([BLOCK_R, NB], dtype=tl.int32)
    if PRUNE:
        # k_c: the first candidate whose scale maps the block max to 6 or below (6 * scale >= amax), by
        # bisection over the ascending scales
        bamax = tl.max(x, axis=2)
        lo = tl.zeros([BLOCK_R, NB], dtype=tl.int32)
        hi = tl.full([BLOCK_R, NB], NC, dtype=tl.int32)
        for _ in range(7):  # 2**7 > NC
            active = lo < hi
            mid = (lo + hi) // 2
            c_mid = tl.load(cand_ptr + tl.minimum(mid, NC - 1))
            below = 6.0 * (c_mid * ga[:, None] / 6.0) < bamax
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & (below == 0), mid, hi)
        start = tl.maximum(lo - BELOW, 0)
        last = tl.minimum(tl.maximum(lo + ABOVE, FIRST_HALVABLE), NC) - 1
    else:
        start = tl.zeros([BLOCK_R, NB], dtype=tl.int32)
        last = tl.full([BLOCK_R, NB], NC - 1, dtype=tl.int32)
    for j in range(STEPS):
        k = tl.minimum(start + j, last)  # past the window: its last candidate again (never strictly better)
        c = tl.load(cand_ptr + k)
        scale = c * ga[:, None] / 6.0
        scale = tl.where(scale == 0.0, 1.0, scale)[:, :, None]
        a = x / scale
        q = _e2m1_round(a)
        diff = x - q * scale
        loss = tl.sum(diff * diff, axis=2)
        better = loss < best_loss
        best_loss = tl.where(better, loss, best_loss)
        best_k = tl.where(better, k, best_k)
    return best_k


def _hessian_loss_body(x, sign, h, denom):
    # dwᵀ H_b dw per row of x [R, 16] (sign: x's signs) under the divisors denom [R]: the codes of
    # fl(x / denom) as the codec writes them, the product in full float32 (no TF32: near-ties must not flip).
    # Returns (the losses [R], the code magnitudes [R, 16]).
    d = denom[:, None]
    mag = _e2m1_round(tl.abs(tl.math.div_rn(x, d)))
    dw = x - sign * mag * d
    return tl.sum(tl.dot(dw, h, input_precision="ieee") * dw, axis=1), mag


def _hessian_sweep_body(
    x_ptr,  # [E, out, in] weights
    h_ptr,  # [E, in/16, 16, 16] float32: each column block's H_b
    hinv_ptr,  # [E, in/16, 16] float32: the diagonal of each H_b⁻¹ (inf where H_b is singular)
    ws2_ptr,  # [E] float32: weight_scale_2 of each matrix
    cand_ptr,  # [NC] float32: the finite positive E4M3 values, ascending
    byte_ptr,  # [NC] uint8: the same values' E4M3 bytes
    best_ptr,  # [E, out, in/16] uint8 out: the chosen block scale's byte
    out_rows,
    n_blocks,
    BLOCK_R: tl.constexpr,
    NC: tl.constexpr,
    PRUNE: tl.constexpr,  # skip the candidates that provably lose (else try all NC)
    BELOW: tl.constexpr,  # with PRUNE: candidates below k_c always tried (HESSIAN_BELOW)
    MARGIN: tl.constexpr,  # with PRUNE: relative margin of the bounds over the float32 losses
):
    # `local_hessian` (qtool.ops.quantize.local_hessian): per row of one 16-column block the candidate scale
    # with the smallest dw^T H_b dw, the first smallest kept (_hessian_search). One program: BLOCK_R rows of
    # one (matrix, column block), so H_b is loaded once and the product runs as a [BLOCK_R, 16] x [16, 16] dot.
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)  # matrix * n_blocks + column block
    mat = pid_b // n_blocks
    blk = pid_b % n_blocks
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < out_rows
    e16 = tl.arange(0, 16)
    row_base = (mat.to(tl.int64) * out_rows + rows) * (n_blocks * 16)
    x = tl.load(x_ptr + row_base[:, None] + blk * 16 + e16[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    h = tl.load(h_ptr + pid_b.to(tl.int64) * 256 + e16[:, None] * 16 + e16[None, :])
    if PRUNE:  # noqa: SIM108 (a constexpr branch: the other is never compiled)
        hinv = tl.load(hinv_ptr + pid_b.to(tl.int64) * 16 + e16)
    else:
        hinv = tl.zeros([16], dtype=tl.float32)  # not read
    ws2 = tl.load(ws2_ptr + mat)
    best_k = _hessian_search(x, rmask, h, hinv, ws2, cand_ptr, BLOCK_R, NC, PRUNE, BELOW, MARGIN)
    byte = tl.load(byte_ptr + best_k)
    tl.store(best_ptr + row_base // 16 + blk, byte, mask=rmask)


def _hessian_search_body(
    x,  # [R, 16] float32: one 16-column block of R rows
    rmask,  # [R]: the rows that exist
    h,  # [16, 16] float32: the block's H_b
    hinv,  # [16] float32: the diagonal of H_b⁻¹ (inf where H_b is singular); read only with PRUNE
    ws2,  # float32: the matrix's weight_scale_2
    cand_ptr,  # [NC] float32: the finite positive E4M3 values, ascending
    BLOCK_R: tl.constexpr,
    NC: tl.constexpr,
    PRUNE: tl.constexpr,
    BELOW: tl.constexpr,
    MARGIN: tl.constexpr,
):
    # The index [R] of each row's candidate with the smallest dwᵀ H_b dw, the first (smallest) on a tie (also
    # GPTQ's group kernel's search, qtool.ops.quantize.gptq_triton).
    # With PRUNE the candidates go in two passes with the same losses and the same tie rule as one ascending
    # pass over all: upwards from k_c - BELOW (k_c: the first candidate whose 6 * divisor reaches the block
    # max) while the bound above leaves a row a chance, then downwards from k_c - BELOW - 1 while the bound
    # below does. A candidate ruled out is worse than the row's best in exact arithmetic; the winner is the
    # single pass's wherever float32 rounding moves a loss by less than MARGIN of the best (an H_b too
    # ill-conditioned for that gets no bound: hessian_inverse_diagonals).
    # Both bounds use dwᵀ H_b dw >= dw_i² / (H_b⁻¹)_ii for every i (H_b positive definite: the least quadratic
    # form with dw_i fixed), with a dw_i every candidate past the current one keeps at least:
    # - above: an element coded 0 (|x_i / d| <= 1/4) has dw_i = x_i, and stays coded 0 under every larger
    #   divisor, so the bound from the elements coded 0 only grows as the candidates do;
    # - below: an element with |x_i| > 6 d keeps at least |x_i| - 6 d (6 is the largest E2M1 magnitude), which
    #   grows as d falls.
    # So once a bound passes a row's best loss (times 1 + MARGIN, for the float32 rounding of the losses) no
    # candidate further on in that direction can win the row.
    sign = tl.where(x < 0.0, -1.0, 1.0)
    best_loss = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
    best_k = tl.zeros([BLOCK_R], dtype=tl.int32)
    if PRUNE:
        ax = tl.abs(x)
        bamax = tl.max(ax, axis=1)
        lo = tl.zeros([BLOCK_R], dtype=tl.int32)
        hi = tl.full([BLOCK_R], NC, dtype=tl.int32)
        for _ in range(7):  # bisection for k_c (2**7 > NC)
            active = lo < hi
            mid = (lo + hi) // 2
            reaches = 6.0 * (tl.load(cand_ptr + tl.minimum(mid, NC - 1)) * ws2) >= bamax
            hi = tl.where(active & reaches, mid, hi)
            lo = tl.where(active & (reaches == 0), mid + 1, lo)
        first = tl.maximum(lo - BELOW, 0)
        gain = 1.0 + MARGIN
        zero_cost = ax * ax / hinv[None, :]  # [R, 16]: each element's bound once it is coded 0
        # upwards: strict, so the first smallest stays; an all-zero row ties at 0 everywhere: its first wins
        k = first
        open_ = rmask
        while tl.max(open_.to(tl.int32), axis=0) > 0:
            kk = tl.minimum(k, NC - 1)
            loss, mag = _hessian_loss(x, sign, h, tl.load(cand_ptr + kk) * ws2)
            better = open_ & (loss < best_loss)
            best_loss = tl.where(better, loss, best_loss)
            best_k = tl.where(better, kk, best_k)
            bound = tl.max(tl.where(mag == 0.0, zero_cost, 0.0), axis=1)
            k = k + 1
            open_ = open_ & (k < NC) & (bamax > 0.0) & (bound <= best_loss * gain)
        # downwards: a smaller candidate wins a tie (it comes first in the single pass's order)
        k = first - 1
        denom = tl.load(cand_ptr + tl.maximum(k, 0)) * ws2
        clip = tl.maximum(ax - 6.0 * denom[:, None], 0.0)
        bound = tl.max(clip * clip / hinv[None, :], axis=1)
        open_ = rmask & (k >= 0) & (bound <= best_loss * gain)
        while tl.max(open_.to(tl.int32), axis=0) > 0:
            kk = tl.maximum(k, 0)
            loss, mag = _hessian_loss(x, sign, h, tl.load(cand_ptr + kk) * ws2)
            take = open_ & (loss <= best_loss)
            best_loss = tl.where(take, loss, best_loss)
            best_k = tl.where(take, kk, best_k)
            k = k - 1
            denom = tl.load(cand_ptr + tl.maximum(k, 0)) * ws2
            clip = tl.maximum(ax - 6.0 * denom[:, None], 0.0)
            bound = tl.max(clip * clip / hinv[None, :], axis=1)
            open_ = open_ & (k >= 0) & (bound <= best_loss * gain)
    else:
        for k in tl.range(NC):  # not unrolled: the dot bodies would only slow the compile
            loss, mag = _hessian_loss(x, sign, h, tl.load(cand_ptr + k) * ws2)
            better = loss < best_loss
            best_loss = tl.where(better, loss, best_loss)
            best_k = tl.where(better, k, best_k)
    return best_k


def _four_over_six_body(
    x_ptr,
    amax_ptr,  # [matrices] float32: the per-matrix amax the global scale comes from
    ws2_ptr,  # [matrices] float32: weight_scale_2 = amax / (6 * 256)
    best_ptr,  # [rows, n_blocks] uint8 out: the chosen block scale's byte
    sixth,  # float32 1/6, as torch's CUDA division by the scalar 6 multiplies by it
    n_rows,
    n_blocks,
    rows_per_mat,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
):
    # `four_over_six` (qtool.ops.quantize.nvfp4_mse.four_over_six_block_scales): each block's max mapped to 6
    # (multiplier 1.0) or to 4 (1.5), the exported E4M3 scale of each computed in the torch code's order of
    # float32 operations, the one whose codes have the smaller squared error kept (max -> 6 on a tie).
    rows, blks, rmask, m2, x = _block_tile(x_ptr, n_rows, n_blocks, BLOCK_R, NB)
    ga = tl.load(amax_ptr + rows // rows_per_mat, mask=rmask, other=1.0)
    ws2 = tl.load(ws2_ptr + rows // rows_per_mat, mask=rmask, other=1.0)
    bamax = tl.max(tl.abs(x), axis=2)
    global_per_block = ga * sixth  # [R]
    sign = tl.where(x < 0.0, -1.0, 1.0)
    best_loss = tl.full([BLOCK_R, NB], float("inf"), dtype=tl.float32)
    best_byte = tl.zeros([BLOCK_R, NB], dtype=tl.int32)
    for i in tl.static_range(2):
        per_block = (bamax * (1.0 + 0.5 * i)) * sixth
        per_block = tl.where(per_block == 0.0, 1.0, per_block)
        s = tl.math.div_rn(per_block * 256.0, global_per_block[:, None])
        s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)  # clamp(2**-9, 448)
        sq, sbyte = _e4m3_rne(s)
        denom = sq * ws2[:, None]
        a = tl.abs(tl.math.div_rn(x, denom[:, :, None]))
        q = _e2m1_round(a)
        diff = sign * q * denom[:, :, None] - x
        loss = tl.sum(diff * diff, axis=2)
        better = loss < best_loss
        best_loss = tl.where(better, loss, best_loss)
        best_byte = tl.where(better, sbyte, best_byte)
    tl.store(best_ptr + rows[:, None] * n_blocks + blks[None, :], best_byte.to(tl.uint8), mask=m2)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Import triton (first call only) and JIT-wrap the kernel bodies. The compiled kernels are kept in
    qtool's cache dir (`$QTOOL_CACHE_DIR/triton`, unless TRITON_CACHE_DIR says otherwise): compiled once per
    machine and CUDA version, found there by every later run (a CI cache keeps them too)."""
    global tl, _e4m3_rne, _e2m1_round, _e2m1_code, _block_tile, _hessian_loss, _hessian_search, _sweep_search
    global _max_scale
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir() / "triton")
    import triton
    import triton.language as tl_mod

    tl = tl_mod
    # called from the kernels: resolved from this module's globals when a kernel compiles
    _e4m3_rne = triton.jit(_e4m3_rne_body)
    _e2m1_round = triton.jit(_e2m1_round_body)
    _e2m1_code = triton.jit(_e2m1_code_body)
    _block_tile = triton.jit(_block_tile_body)
    _hessian_loss = triton.jit(_hessian_loss_body)
    _hessian_search = triton.jit(_hessian_search_body)
    _sweep_search = triton.jit(_sweep_search_body)
    _max_scale = triton.jit(_max_scale_body)
    return triton.jit(_amax_body), triton.jit(_quantize_body)


@functools.cache
def _sweep_kernel() -> Any:
    _kernels()  # binds `tl` and the cache dir
    import triton

    return triton.jit(_sweep_body)


class _BlockSearch:
    """What a per-block scale search launches over: the weight (contiguous), its leading dims, rows per matrix,
    blocks per row and rows in all, the output (one E4M3 byte per block, uint8 [*lead, out, in/16]) and the
    grid of (row tile, block tile) programs (None when there is nothing to search)."""

    def __init__(self, w: torch.Tensor, tile: TileConfig) -> None:
        nvfp4.check_weight(w)
        self.w = w.contiguous()
        self.lead, self.out = tuple(w.shape[:-2]), w.shape[-2]
        self.nb = w.shape[-1] // BLOCK_SIZE
        self.n_rows = torch.Size(self.lead).numel() * self.out
        self.best = torch.empty((*self.lead, self.out, self.nb), dtype=torch.uint8, device=w.device)
        self.grid = (
            (_cdiv(self.n_rows, tile.block_rows), _cdiv(self.nb, tile.blocks_per_tile))
            if self.n_rows and self.nb
            else None
        )


def sweep_block_scales_triton(
    w: torch.Tensor, global_amax: torch.Tensor, tile: TileConfig = DEFAULT_TILE, prune: bool = True
) -> torch.Tensor:
    """`qtool.ops.quantize.nvfp4_mse.sweep_block_scales` as one Triton launch (CUDA tensors). `prune=False`
    tries all 126 candidates in every block (the same bytes, about 4x the work: for tests and timings)."""
    search = _BlockSearch(w, tile)
    w, lead, out, nb, n_rows, best = search.w, search.lead, search.out, search.nb, search.n_rows, search.best
    scale_bytes = nvfp4.fp8_scale_bytes(w.device)
    candidates = (scale_bytes.view(torch.float8_e4m3fn).float() / nvfp4.E4M3_MAX).contiguous()
    amax = torch.as_tensor(global_amax, device=w.device).float().expand(lead).contiguous()
    if search.grid:
        _sweep_kernel()[search.grid](
            w,
            amax,
            candidates,
            scale_bytes.contiguous(),
            best,
            n_rows,
            nb,
            out,
            BLOCK_R=tile.block_rows,
            NB=tile.blocks_per_tile,
            NC=int(candidates.numel()),
            PRUNE=prune,
            BELOW=nvfp4.SWEEP_BELOW,
            ABOVE=nvfp4.SWEEP_ABOVE,
            FIRST_HALVABLE=nvfp4.SWEEP_FIRST_HALVABLE,
            STEPS=nvfp4.SWEEP_BELOW + nvfp4.SWEEP_ABOVE if prune else int(candidates.numel()),
            num_warps=tile.num_warps,
        )
    return best.view(torch.float8_e4m3fn)


@functools.cache
def _four_over_six_kernel() -> Any:
    _kernels()  # binds `tl`, the jit helpers and the cache dir
    import triton

    return triton.jit(_four_over_six_body)


def four_over_six_block_scales_triton(
    w: torch.Tensor, global_amax: torch.Tensor, weight_scale_2: torch.Tensor, tile: TileConfig = DEFAULT_TILE
) -> torch.Tensor:
    """`qtool.ops.quantize.nvfp4_mse.four_over_six_block_scales`' block scales as one Triton launch (CUDA
    tensors): float8_e4m3fn [..., out, in/16]. global_amax and weight_scale_2 per matrix (shape w.shape[:-2])."""
    search = _BlockSearch(w, tile)
    w, lead, out, nb, n_rows, best = search.w, search.lead, search.out, search.nb, search.n_rows, search.best
    amax = torch.as_tensor(global_amax, device=w.device).float().expand(lead).contiguous()
    ws2 = torch.as_tensor(weight_scale_2, device=w.device).float().expand(lead).contiguous()
    sixth = float(torch.tensor(1.0) / nvfp4.E2M1_MAX)  # float32 1/6, correctly rounded
    if search.grid:
        _four_over_six_kernel()[search.grid](
            w,
            amax,
            ws2,
            best,
            sixth,
            n_rows,
            nb,
            out,
            BLOCK_R=tile.block_rows,
            NB=tile.blocks_per_tile,
            num_warps=tile.num_warps,
        )
    return best.view(torch.float8_e4m3fn)


@functools.cache
def _hessian_sweep_kernel() -> Any:
    _kernels()  # binds `tl` and the cache dir
    import triton

    return triton.jit(_hessian_sweep_body)


def hessian_block_scales_triton(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor,
    hessian: torch.Tensor,
    block_rows: int = 32,
    prune: bool = True,
    inverse_diagonal: torch.Tensor | None = None,
) -> torch.Tensor:
    """float8_e4m3fn [E, out, in/16]: per block the E4M3 scale with the smallest dw^T H_b dw
    (`qtool.ops.quantize.local_hessian._search` as one launch; CUDA tensors). w [E, out, in]; weight_scale_2
    float32 [E]; hessian float32 [E, in/16, 16, 16]. `prune` skips the candidates the kernel's bounds rule out
    (the same winner; `prune=False` tries all 126: for tests and timings); `inverse_diagonal` [E, in/16, 16]:
    the diagonals of the H_b⁻¹ where the caller has them (else computed here, `hessian_inverse_diagonals`)."""
    nvfp4.check_weight(w)
    w = w.contiguous()
    n_exp, out, n_in = w.shape
    nb = n_in // BLOCK_SIZE
    scale_bytes = nvfp4.fp8_scale_bytes(w.device).contiguous()
    values = scale_bytes.view(torch.float8_e4m3fn).float().contiguous()
    h = hessian.to(w.device, torch.float32).reshape(n_exp, nb, BLOCK_SIZE, BLOCK_SIZE).contiguous()
    if inverse_diagonal is None:
        inverse_diagonal = hessian_inverse_diagonals(h) if prune else torch.empty(0, device=w.device)
    hinv = inverse_diagonal.to(w.device, torch.float32).contiguous()
    ws2 = torch.as_tensor(weight_scale_2, device=w.device).float().reshape(n_exp).contiguous()
    best = torch.empty((n_exp, out, nb), dtype=torch.uint8, device=w.device)
    if n_exp and out and nb:
        grid = (_cdiv(out, block_rows), n_exp * nb)
        _hessian_sweep_kernel()[grid](
            w,
            h,
            hinv,
            ws2,
            values,
            scale_bytes,
            best,
            out,
            nb,
            BLOCK_R=block_rows,
            NC=int(values.numel()),
            PRUNE=prune,
            BELOW=HESSIAN_BELOW,
            MARGIN=HESSIAN_MARGIN,
            num_warps=4,
        )
    return best.view(torch.float8_e4m3fn)


# local_hessian's pruned search: the candidates from k_c - HESSIAN_BELOW upwards are always tried (the winner
# lies there in nearly every block: the bound's pass below then stops at once), and the bound must exceed a
# row's best loss by HESSIAN_MARGIN (relative) before it rules a candidate out
HESSIAN_BELOW = 8
HESSIAN_MARGIN = 1e-3
# H_b whose Cholesky diagonal spans more than this ratio is treated as singular (no bound: every candidate)
_WORST_CONDITION = 1e6


def hessian_inverse_diagonals(h: torch.Tensor) -> torch.Tensor:
    """[..., 16] float32: the diagonal of each H_b⁻¹ of h [..., 16, 16], in float64; inf where H_b is not
    positive definite or so ill-conditioned that float64 could not bound it (the search's bound is then 0)."""
    flat = h.reshape(-1, BLOCK_SIZE, BLOCK_SIZE).double()
    lower, info = torch.linalg.cholesky_ex(flat)
    pivots = lower.diagonal(dim1=-2, dim2=-1).abs()
    sound = (info == 0) & (pivots.amin(-1) * _WORST_CONDITION > pivots.amax(-1))
    eye = torch.eye(BLOCK_SIZE, dtype=lower.dtype, device=lower.device)
    lower = torch.where(sound[:, None, None], lower, eye)  # the others' factors may hold zeros: not inverted
    diag = torch.cholesky_inverse(lower).diagonal(dim1=-2, dim2=-1)
    sound = sound[:, None] & diag.isfinite() & (diag > 0)
    return torch.where(sound, diag, torch.inf).float().reshape(h.shape[:-1])


# ---------------------------------------------------------------- launchers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def matrix_amax_triton(w: torch.Tensor, tile: TileConfig = DEFAULT_TILE) -> torch.Tensor:
    """max |w| per [out, in] matrix, float32 of shape w.shape[:-2] (== nvfp4.matrix_amax, NaN included)."""
    nvfp4.check_weight(w)
    amax_k, _ = _kernels()
    w = w.contiguous()
    lead = tuple(w.shape[:-2])
    n_mat = torch.Size(lead).numel()
    per = w.shape[-2] * w.shape[-1]
    if n_mat == 0 or per == 0:
        return nvfp4.matrix_amax(w)
    block = tile.amax_block
    splits = max(1, min(tile.amax_splits, _cdiv(per, block * 4)))
    steps = _cdiv(_cdiv(per, splits), block)  # each program reduces steps * block elements
    splits = _cdiv(per, steps * block)
    part = torch.empty((n_mat, splits), dtype=torch.float32, device=w.device)
    amax_k[(n_mat, splits)](w, part, per, BLOCK=block, STEPS=steps, num_warps=tile.num_warps)
    return part.amax(dim=1).reshape(lead)


def quantize_triton(
    w: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    weight_scale_2: torch.Tensor | float | None = None,
    tile: TileConfig = DEFAULT_TILE,
) -> nvfp4.NVFP4Weight:
    """The Triton kernels; same arguments and result as `nvfp4.quantize` (without block_scale)."""
    nvfp4.check_weight(w)
    if global_amax is not None and weight_scale_2 is not None:
        raise CodecError("pass global_amax or weight_scale_2, not both")
    if w.device.type != "cuda" and not _interpret():
        raise CodecError(
            "the Triton NVFP4 kernel needs a CUDA tensor",
            got=str(w.device),
            hint="use quantize_fast (falls back to the torch codec) or set TRITON_INTERPRET=1 for tests",
        )
    _, quant_k = _kernels()
    w = w.contiguous()
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    if weight_scale_2 is not None:
        ws2 = torch.as_tensor(weight_scale_2, device=w.device).float()
    else:
        amax = matrix_amax_triton(w, tile) if global_amax is None else torch.as_tensor(global_amax, device=w.device)
        ws2 = nvfp4.weight_scale_2_from_amax(amax)  # same torch op as the reference: same bits
    ws2 = (ws2.reshape(()) if ws2.numel() == 1 else ws2).expand(lead).contiguous()
    n_rows = torch.Size(lead).numel() * out
    nb = n_in // BLOCK_SIZE
    packed = torch.empty((*lead, out, n_in // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((*lead, out, nb), dtype=torch.uint8, device=w.device)
    if n_rows and nb:
        grid = (_cdiv(n_rows, tile.block_rows), _cdiv(nb, tile.blocks_per_tile))
        quant_k[grid](
            w,
            ws2,
            packed,
            scales,
            n_rows,
            nb,
            out,
            BLOCK_R=tile.block_rows,
            NB=tile.blocks_per_tile,
            num_warps=tile.num_warps,
        )
    return nvfp4.NVFP4Weight(packed, scales.view(torch.float8_e4m3fn), ws2)


def quantize_fast(
    w: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    weight_scale_2: torch.Tensor | float | None = None,
    block_scale: torch.Tensor | None = None,
    backend: Backend = Backend.AUTO,
) -> nvfp4.NVFP4Weight:
    """`nvfp4.quantize` with the same arguments and bit-identical result, on the Triton kernel when it can.

    AUTO runs the kernel for CUDA tensors when triton imports, and the torch codec otherwise (CPU
    tensors, no triton, or a caller-supplied block_scale, which the kernel does not take).
    """
    use_triton = backend is Backend.TRITON or (
        backend is Backend.AUTO and block_scale is None and w.is_cuda and triton_available()
    )
    if use_triton:
        if block_scale is not None:
            raise CodecError("the Triton NVFP4 kernel computes its own block scales", hint="use Backend.TORCH")
        return quantize_triton(w, global_amax=global_amax, weight_scale_2=weight_scale_2)
    return nvfp4.quantize(w, global_amax=global_amax, weight_scale_2=weight_scale_2, block_scale=block_scale)
