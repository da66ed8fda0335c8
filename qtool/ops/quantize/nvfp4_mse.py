"""MSE-searched NVFP4 block scales (recipe `nvfp4.weight_scale: mse`, `--backend rtn`).

The global scale stays amax / (6 * 448) (ModelOpt convention, so gate/up still share it); each 16-element
block's FP8 scale is chosen among the round-to-nearest scale of the block amax shrunk by factors
1.0, 0.95, ..., 0.70 (then cast to E4M3) as the one with the smallest squared reconstruction error of that
block. Factor 1.0 is the RTN scale, so the result is never worse than RTN per block. This is the same idea
as ModelOpt's `mse` calibration of static NVFP4 block amaxes (modelopt/torch/quantization/calib/mse.py),
written vectorised over all blocks at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.formats import nvfp4, nvfp4_triton
from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

FACTORS = tuple(1.0 - 0.05 * i for i in range(7))


def search_block_scales(weight: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., out, in/16] block scales minimising per-block squared error."""
    lead, out, n_in = tuple(weight.shape[:-2]), weight.shape[-2], weight.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    ws2 = (
        torch.as_tensor(weight_scale_2).float().reshape(*lead, 1, 1, 1)
        if lead
        else torch.as_tensor(weight_scale_2).float().reshape(())
    )
    x = weight.float().reshape(*lead, out, nb, nvfp4.BLOCK_SIZE)
    bamax = x.abs().amax(dim=-1)
    best_err = None
    best = None
    for f in FACTORS:
        ws = ws2 if not lead else ws2.squeeze(-1)
        s = bamax * f / (nvfp4.E2M1_MAX * ws)
        s = torch.where((s == 0) | s.isnan(), torch.ones_like(s), s).clamp(nvfp4.E4M3_MIN_SCALE, nvfp4.E4M3_MAX)
        s8 = s.to(torch.float8_e4m3fn)
        denom = (s8.float() * ws).unsqueeze(-1)
        deq = nvfp4.decode_e2m1(nvfp4.encode_e2m1(x / denom)) * denom
        err = (deq - x).pow(2).sum(dim=-1)
        if best is None:
            best, best_err = s8, err
        else:
            better = err < best_err
            best = torch.where(better, s8.float(), best.float()).to(torch.float8_e4m3fn)
            best_err = torch.where(better, err, best_err)
    return best


# ---------------------------------------------------------------------------------------------------
# `mse_sweep`: every finite positive E4M3 value tried as each block's scale (ModelOpt 0.47's
# NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG: modelopt/torch/quantization/calib/mse.py `NVFP4MSECalibrator`,
# kernels/quantization/gemm/nvfp4_fp8_sweep.py). Its loss is the block's squared error with the block scale
# c * global_amax / 6, c = e4m3 / 448 (a value the E4M3 cast of the exported scale returns unchanged), the
# first (smallest) scale kept on a tie. The exported block scale is then that E4M3 value itself.

SWEEP_ROWS = 4096  # rows of blocks per step: bounds the sweep's temporaries to a few tens of MB


def fp8_scale_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 126 finite positive float8_e4m3fn values, ascending, as float32."""
    return nvfp4.fp8_scale_bytes(device).view(torch.float8_e4m3fn).float()


def _magnitude(a: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value (ties to the even code), for x already scaled."""
    return nvfp4.decode_e2m1(nvfp4.encode_e2m1(a))


def sweep_block_scales(weight: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., out, in/16]: for each block the E4M3 scale with the smallest squared error.

    `global_amax` is the per-matrix amax the global scale comes from (shape weight.shape[:-2], or a scalar;
    gate and up of an expert pass the larger of their two, as they share weight_scale_2)."""
    nvfp4.check_weight(weight)
    if weight.is_cuda and nvfp4_triton.triton_available():
        return nvfp4_triton.sweep_block_scales_triton(weight, global_amax)
    lead, out, n_in = tuple(weight.shape[:-2]), weight.shape[-2], weight.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    values = fp8_scale_values(weight.device)
    candidates = values / nvfp4.E4M3_MAX
    amax = torch.as_tensor(global_amax, device=weight.device).float().expand(lead).reshape(-1, 1)
    row_amax = amax.repeat_interleave(out, dim=0).unsqueeze(-1)  # [R, 1, 1]
    rows = weight.reshape(-1, nb, nvfp4.BLOCK_SIZE)
    best = torch.empty(rows.shape[:2], dtype=torch.long, device=weight.device)
    for r0 in range(0, rows.shape[0], SWEEP_ROWS):
        x = rows[r0 : r0 + SWEEP_ROWS].float().abs()
        ga = row_amax[r0 : r0 + SWEEP_ROWS].squeeze(-1)  # [r, 1]
        # each block tries only the candidates that can win (nvfp4.sweep_window), in ascending order
        first, last = nvfp4.sweep_window(6.0 * (candidates * ga / 6.0), x.amax(dim=-1))
        best_loss = torch.full(x.shape[:2], float("inf"), device=weight.device)
        best_idx = torch.zeros(x.shape[:2], dtype=torch.long, device=weight.device)
        for j in range(nvfp4.SWEEP_BELOW + nvfp4.SWEEP_ABOVE):
            k = torch.minimum(first + j, last)  # past the window: its last candidate again (never better)
            scale = candidates[k] * ga / 6.0
            scale = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)  # an all-zero matrix
            loss = (x - _magnitude(x / scale) * scale).pow(2).sum(dim=-1)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_idx = torch.where(better, k, best_idx)
        best[r0 : r0 + SWEEP_ROWS] = best_idx
    return values[best].to(torch.float8_e4m3fn).reshape(*lead, out, nb)


# ---------------------------------------------------------------------------------------------------
# `four_over_six`: each block's maximum mapped to 6 (the max scale) or to 4 (1.5x that scale), the one with
# the smaller squared error of the block kept, the max-to-6 scale on a tie. ModelOpt 0.47's
# NVFP4_FOUR_OVER_SIX_CFG (modelopt_recipes/configs/ptq/presets/model/nvfp4_four_over_six.yaml): the `mse`
# calibration with amax multipliers linspace(1.0, 1.5, 2) per block (calib/mse.py `MseCalibrator`: squared
# error summed per block, torch.argmin, so the first multiplier wins a tie) and block scales normalised to
# 256 rather than 448 (`E4M3_MAX_46`), so 1.5 * 256 still fits E4M3. Its export (qtensor/nvfp4_tensor.py
# `get_weights_scaling_factor_from_quantizer`, static path) writes
#     weight_scale_2 = global_amax / (6 * 256)
#     weight_scale   = e4m3(clamp((m * block_amax / 6 [0 -> 1.0]) * 256 / (global_amax / 6), 2**-9, 448))
# and the codes are RTN of w / (float(weight_scale) * weight_scale_2). qtool measures each multiplier's error
# with exactly those exported scales (the error of the bytes written).

FOUR_OVER_SIX_MULTIPLIERS = (1.0, 1.5)  # block max -> 6, block max -> 4


def _four_over_six_scale(block_amax: torch.Tensor, row_amax: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The E4M3 block scale ModelOpt exports for the per-block amax `multiplier * block_amax`."""
    per_block = block_amax * multiplier / nvfp4.E2M1_MAX
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    scaled = per_block * nvfp4.E4M3_MAX_FOUR_OVER_SIX / (row_amax / nvfp4.E2M1_MAX)
    return scaled.clamp(nvfp4.E4M3_MIN_SCALE, nvfp4.E4M3_MAX).to(torch.float8_e4m3fn)


def four_over_six_block_scales(weight: torch.Tensor, global_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn block scales [..., out, in/16], float32 weight_scale_2 [...]) of four-over-six.

    `global_amax` as for `sweep_block_scales` (gate and up pass the larger of their two amaxes)."""
    nvfp4.check_weight(weight)
    lead = tuple(weight.shape[:-2])
    amax = torch.as_tensor(global_amax, device=weight.device).float().expand(lead).contiguous()
    ws2 = nvfp4.weight_scale_2_from_amax(amax, nvfp4.E4M3_MAX_FOUR_OVER_SIX)
    if weight.is_cuda and nvfp4_triton.triton_available():
        return nvfp4_triton.four_over_six_block_scales_triton(weight, amax, ws2), ws2
    return _four_over_six_torch(weight, amax, ws2), ws2


def _four_over_six_torch(weight: torch.Tensor, amax: torch.Tensor, ws2: torch.Tensor) -> torch.Tensor:
    """four_over_six's block scales in torch ops (CPU, or no triton), amax and ws2 per matrix."""
    lead, out, n_in = tuple(weight.shape[:-2]), weight.shape[-2], weight.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    row_amax = amax.reshape(-1, 1).repeat_interleave(out, dim=0)  # [R, 1]
    row_ws2 = ws2.reshape(-1, 1).repeat_interleave(out, dim=0)
    rows = weight.reshape(-1, nb, nvfp4.BLOCK_SIZE)
    best = torch.empty(rows.shape[:2], dtype=torch.float8_e4m3fn, device=weight.device)
    for r0 in range(0, rows.shape[0], SWEEP_ROWS):
        x = rows[r0 : r0 + SWEEP_ROWS].float()
        block_amax = x.abs().amax(dim=-1)
        best_loss = None
        for m in FOUR_OVER_SIX_MULTIPLIERS:
            s8 = _four_over_six_scale(block_amax, row_amax[r0 : r0 + SWEEP_ROWS], m)
            # the divisor and the codes as the codec writes them (nvfp4.quantize)
            denom = (s8.float() * row_ws2[r0 : r0 + SWEEP_ROWS]).unsqueeze(-1)
            loss = (_magnitude(x / denom) * denom - x).pow(2).sum(dim=-1)  # signed codes: x is not abs'd
            if best_loss is None:
                chunk, best_loss = s8, loss
            else:
                better = loss < best_loss  # strict: a tie keeps the first multiplier (max -> 6)
                chunk = torch.where(better, s8.float(), chunk.float()).to(torch.float8_e4m3fn)
                best_loss = torch.where(better, loss, best_loss)
        best[r0 : r0 + SWEEP_ROWS] = chunk
    return best.reshape(*lead, out, nb)
