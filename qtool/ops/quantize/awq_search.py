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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.formats import awq
from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# the float32 candidates of one batched RTN: 7 alphas of a 397B down_proj (4096 x 1024); the RTN's
# temporaries are 4-5x that (~0.6 GB), so the search adds little to the GPU peak of the forward it
# overlaps. The chunk's final coding (and its fold) goes by batches of the same bound.
CANDIDATE_BYTES = 128 << 20


def rtn(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> awq.Int4Weight:
    """Symmetric RTN INT4 (compressed-tensors W4A16 numerics: scale = amax / 7.5 in `scale_dtype`)."""
    return awq.quantize(weight, group_size, symmetric=True, scale_dtype=scale_dtype)


@dataclass
class ChunkScales:
    """The search's result for a chunk of k experts, on the weights' device until `report` (one host sync
    for the chunk, after its codes are queued)."""

    s: torch.Tensor  # float32 [k, I]: down_proj column scales (1 where the expert had no rows)
    best: torch.Tensor  # int64 [k]: the chosen alpha's index in the grid
    best_err: torch.Tensor  # float32 [k]
    rtn_err: torch.Tensor  # float32 [k]: alpha 0's error (plain RTN)
    grid: int

    def report(self, first_expert: int) -> list[dict]:
        """Per expert: the alpha and the errors; an error that is not finite (the expert's rows hold a NaN
        or an inf: it got plain RTN, s = 1) is None, so the manifest stays JSON."""
        best, err, rtn_err = (t.tolist() for t in (self.best, self.best_err, self.rtn_err))
        return [
            {"expert": first_expert + k, "alpha": b / self.grid, "down_mse": _finite(m), "down_mse_rtn": _finite(r)}
            for k, (b, m, r) in enumerate(zip(best, err, rtn_err, strict=True))
        ]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def alpha_scales(x_mean: torch.Tensor, grid: int) -> torch.Tensor:
    """s = mean|x|^alpha for alpha = i / grid, each normalised by sqrt(max * min): [grid, k, I] from
    x_mean [k, I], every value the one an expert-by-expert search computes. The power is taken one
    expert's row at a time, with a scalar exponent: torch's CPU pow codes the elements of a SIMD vector
    and a tensor's tail differently (last-bit differences where I is not a multiple of the vector), so a
    [k, I] call would not give each row's [I] result; the exponent keeps torch's special cases (alpha 0.5
    is a sqrt). The rest is exact elementwise (max, min, product, sqrt, division) and runs on the chunk."""
    out = []
    for i in range(grid):
        s = torch.stack([x_mean[j].pow(i / grid) for j in range(x_mean.shape[0])]).clamp(min=1e-4)
        out.append(s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt())
    return torch.stack(out)


def awq_down_scales(
    rows: list[torch.Tensor],
    w_down: torch.Tensor,
    group_size: int,
    grid: int,
    scale_dtype: torch.dtype | None = None,
) -> ChunkScales:
    """Best per-input-channel scales for the down_proj of a chunk of experts (W [k, H, I]) given each
    expert's activations rows[k] [n_k, I] (n_k may be 0: s = 1, alpha 0).

    Alpha 0 is plain RTN, so the chosen scale is never worse than RTN on these activations; the first
    lowest error wins and NaN never does (all NaN: alpha 0). The candidate weights of all alphas are coded
    in one batched RTN per expert ([grid, H, I]: elementwise and max/min, so each slice is bit for bit
    the one-alpha RTN), the errors stay on the device, and nothing syncs with the host: the search, the
    fold and the codes of a whole chunk are queued before the writer waits for its bytes. `scale_dtype`:
    BF16 unless given (None: torch is imported on first use, not with this module)."""
    if scale_dtype is None:
        scale_dtype = torch.bfloat16
    k, _, n_in = w_down.shape
    dev = w_down.device
    xs = [r.to(dev, non_blocking=True).float() for r in rows]  # pinned host rows (CUDA): no sync
    x_mean = torch.ones(k, n_in, device=dev)
    for j, x in enumerate(xs):
        if x.numel():
            x_mean[j] = x.abs().mean(dim=0)
    scales = alpha_scales(x_mean, grid)  # [grid, k, I]; an expert without rows: all ones (x_mean 1)
    # nothing below copies from the host (a tensor made from Python values would): no sync
    errs = torch.zeros(k, grid, device=dev)  # an expert without rows: all 0, so alpha 0 (s = 1) wins
    for j, x in enumerate(xs):
        if not x.numel():
            continue
        wf = w_down[j].float()
        ref = x @ wf.t()
        err = []
        step = max(1, CANDIDATE_BYTES // (wf.numel() * 4))
        for i0 in range(0, grid, step):
            i1 = min(grid, i0 + step)
            s_b = scales[i0:i1, j, None, :]
            wq = rtn((wf * s_b).to(w_down.dtype), group_size, scale_dtype).dequantize(torch.float32)
            xs_b = x / s_b  # [b, n, I]: each slice is x / s of its alpha
            out = torch.empty(i1 - i0, *ref.shape, device=dev)
            for b in range(i1 - i0):
                torch.mm(xs_b[b], wq[b].t(), out=out[b])  # as x / s @ wq.t() alone (same call, same layout)
            d = (out - ref).pow_(2)  # elementwise: each slice as its own; the means stay one per alpha
            err += [d[b].mean() for b in range(i1 - i0)]
        errs[j] = torch.stack(err)
    best = torch.where(errs.isnan(), float("inf"), errs).argmin(dim=1)  # the first lowest; NaN never wins
    s = scales.permute(1, 0, 2)[torch.arange(k, device=dev), best]  # [k, I]
    best_err = errs.gather(1, best[:, None]).squeeze(1)
    return ChunkScales(s, best, best_err, errs[:, 0], grid)
