"""MSE-searched NVFP4 block scales (recipe `nvfp4.weight_scale: mse`, `--backend rtn`).

The global scale stays amax / (6 * 448) (ModelOpt convention, so gate/up still share it); each 16-element
block's FP8 scale is chosen among the round-to-nearest scale of the block amax shrunk by factors
1.0, 0.95, ..., 0.70 (then cast to E4M3) as the one with the smallest squared reconstruction error of that
block. Factor 1.0 is the RTN scale, so the result is never worse than RTN per block. This is the same idea
as ModelOpt's `mse` calibration of static NVFP4 block amaxes (modelopt/torch/quantization/calib/mse.py),
written vectorised over all blocks at once.
"""

from __future__ import annotations

import torch

from qtool.formats import nvfp4, nvfp4_triton

FACTORS = tuple(1.0 - 0.05 * i for i in range(7))


def search_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., out, in/16] block scales minimising per-block squared error."""
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    ws2 = (
        torch.as_tensor(weight_scale_2).float().reshape(*lead, 1, 1, 1)
        if lead
        else torch.as_tensor(weight_scale_2).float().reshape(())
    )
    x = w.float().reshape(*lead, out, nb, nvfp4.BLOCK_SIZE)
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
    """|x| rounded to the nearest E2M1 magnitude (ties to the even code), for x already scaled."""
    return nvfp4.decode_e2m1(nvfp4.encode_e2m1(a))


def sweep_block_scales(w: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., out, in/16]: for each block the E4M3 scale with the smallest squared error.

    `global_amax` is the per-matrix amax the global scale comes from (shape w.shape[:-2], or a scalar;
    gate and up of an expert pass the larger of their two, as they share weight_scale_2)."""
    nvfp4.check_weight(w)
    if w.is_cuda and nvfp4_triton.triton_available():
        return nvfp4_triton.sweep_block_scales_triton(w, global_amax)
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    values = fp8_scale_values(w.device)
    candidates = values / nvfp4.E4M3_MAX
    amax = torch.as_tensor(global_amax, device=w.device).float().expand(lead).reshape(-1, 1)
    row_amax = amax.repeat_interleave(out, dim=0).unsqueeze(-1)  # [R, 1, 1]
    rows = w.reshape(-1, nb, nvfp4.BLOCK_SIZE)
    best = torch.empty(rows.shape[:2], dtype=torch.long, device=w.device)
    for r0 in range(0, rows.shape[0], SWEEP_ROWS):
        x = rows[r0 : r0 + SWEEP_ROWS].float().abs()
        ga = row_amax[r0 : r0 + SWEEP_ROWS]
        best_loss = torch.full(x.shape[:2], float("inf"), device=w.device)
        best_idx = torch.zeros(x.shape[:2], dtype=torch.long, device=w.device)
        for k in range(candidates.numel()):
            scale = candidates[k] * ga / 6.0
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero matrix
            loss = (x - _magnitude(x / scale) * scale).pow(2).sum(dim=-1)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_idx = torch.where(better, k, best_idx)
        best[r0 : r0 + SWEEP_ROWS] = best_idx
    return values[best].to(torch.float8_e4m3fn).reshape(*lead, out, nb)
