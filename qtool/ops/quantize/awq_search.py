"""AWQ activation-aware scale search for the routed experts' down_proj (quantize-specific; the INT4 codec
and both packings are qtool.formats.awq).

AWQ (Lin et al. 2023; llm-compressor modifiers/transform/awq `_compute_best_scale`): for the down_proj
of each expert, search s = mean|x|^alpha over alpha in a grid, scale down_proj's input columns by s and
divide up_proj's output rows by s (exact: act(gate) * (up / s) feeds (down * s)), and keep the alpha with
the lowest output MSE on the expert's own routed activations. gate_proj/up_proj get plain RTN: their
input comes from post_attention_layernorm, shared by the router, the shared expert and all experts, so a
per-expert scale cannot be folded anywhere (llm-compressor folds ONE scale for all experts into the
norm and the router; with a BF16 router and shared expert that would change BF16 weights too).
"""

from __future__ import annotations

import torch

from qtool.formats import awq


def rtn(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> awq.Int4Weight:
    """Symmetric RTN INT4 (compressed-tensors W4A16 numerics: scale = amax / 7.5 in `scale_dtype`)."""
    return awq.quantize(w, group_size, symmetric=True, scale_dtype=scale_dtype)


def awq_down_scales(x: torch.Tensor, w_down: torch.Tensor, group_size: int, grid: int,
                    scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, float, float, float]:
    """Best per-input-channel scale s [I] for down_proj (W [H, I]) given activations x [n, I].

    Returns (s, best_alpha, best_mse, rtn_mse); s = 1 (alpha 0) when x is empty. Alpha 0 is plain RTN,
    so the chosen scale is never worse than RTN on these activations."""
    n_in = w_down.shape[-1]
    if x.numel() == 0:
        return torch.ones(n_in, device=w_down.device), 0.0, 0.0, 0.0
    xf = x.to(w_down.device).float()  # the kept rows live on the host; the search runs where the weights are
    wf = w_down.float()
    ref = xf @ wf.t()
    x_mean = xf.abs().mean(dim=0)
    scales, errs = [], []
    for i in range(grid):  # every alpha's error stays on the device: one host sync per expert, not per alpha
        s = x_mean.pow(i / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = rtn((wf * s).to(w_down.dtype), group_size, scale_dtype).dequantize(torch.float32)
        scales.append(s)
        errs.append(((xf / s) @ wq.t() - ref).pow(2).mean())
    values = torch.stack(errs).tolist()
    best, best_err = None, float("inf")
    for i, err in enumerate(values):  # the first lowest (NaN never wins), as the one-at-a-time search chose
        if err < best_err:
            best, best_err = i, err
    return (None, 0.0, best_err, values[0]) if best is None else (scales[best], best / grid, best_err, values[0])
