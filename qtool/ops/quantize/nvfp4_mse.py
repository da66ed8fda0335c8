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

from qtool.formats import nvfp4

FACTORS = tuple(1.0 - 0.05 * i for i in range(7))


def search_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., out, in/16] block scales minimising per-block squared error."""
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    nb = n_in // nvfp4.BLOCK_SIZE
    ws2 = torch.as_tensor(weight_scale_2).float().reshape(*lead, 1, 1, 1) if lead else torch.as_tensor(weight_scale_2).float().reshape(())
    x = w.float().reshape(*lead, out, nb, nvfp4.BLOCK_SIZE)
    bamax = x.abs().amax(dim=-1)
    best_err = None
    best = None
    for f in FACTORS:
        ws = ws2 if not lead else ws2.squeeze(-1)
        s = (bamax * f / (nvfp4.E2M1_MAX * ws))
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
