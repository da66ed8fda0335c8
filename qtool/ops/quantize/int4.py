"""INT4 W4A16 weight codec (symmetric, per-group scales) and its two checkpoint packings, plus the AWQ
activation-aware scale search used on the routed experts.

Numerics follow compressed-tensors (compressed_tensors/quantization/utils/helpers.py
`calculate_qparams`, symmetric: scale = amax / ((qmax - qmin) / 2) = amax / 7.5, stored in the weight's
dtype; quantize `round(w / scale)` clamped to [-8, 7]).

Group size: `group_size` elements of the input dim share a scale. A module whose in-features are fewer
than the group size uses ONE group per row (group = in-features); its scale is [out, 1], which is what
vLLM's ceil(in / group_size) scale shape gives for such a module.

Packings:
  compressed-tensors `pack-quantized` (compressed_tensors/compressors/quantized_compressors/
  pack_quantized.py `pack_to_int32`): q + 8 as unsigned nibbles, 8 per int32 along the input dim,
  element 0 in the lowest bits; `weight_packed` I32 [out, in/8], `weight_scale` [out, in/g],
  `weight_shape` I64 [2].
  AutoAWQ GEMM (formats doc section 5; AutoAWQ awq/modules/linear/gemm.py): `qweight` I32 [in, out/8]
  with nibble order [0, 2, 4, 6, 1, 3, 5, 7], `qzeros` I32 [in/g, out/8] (zero point 8 for a symmetric
  code), `scales` F16 [in/g, out].

AWQ (Lin et al. 2023; llm-compressor modifiers/transform/awq `_compute_best_scale`): for the down_proj
of each expert, search s = mean|x|^alpha over alpha in a grid, scale down_proj's input columns by s and
divide up_proj's output rows by 1/s (exact: act(gate) * up / s feeds down * s), and keep the alpha with
the lowest output MSE on the expert's own routed activations. gate_proj/up_proj get plain RTN: their
input comes from post_attention_layernorm, shared by the router, the shared expert and all experts, so a
per-expert scale cannot be folded anywhere (llm-compressor folds ONE scale for all experts into the
norm and the router; with a BF16 router and shared expert that would change BF16 weights too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.formats import CodecError

QMIN, QMAX = -8, 7
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def effective_group(in_features: int, group_size: int) -> int:
    g = in_features if in_features < group_size else group_size
    if in_features % g:
        raise CodecError("INT4 needs in-features divisible by the group size", expected=f"multiple of {g}",
                         got=in_features, hint="keep this module BF16")
    return g


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # int8 [..., out, in] in [-8, 7]
    scale: torch.Tensor  # [..., out, in/g] in the weight dtype
    group: int

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        s = self.scale.float().repeat_interleave(self.group, dim=-1)
        return (self.q.float() * s).to(dtype)


def quantize(w: torch.Tensor, group_size: int, scale_dtype=None) -> Int4Weight:
    if w.ndim < 2 or not w.is_floating_point():
        raise CodecError("INT4 quantize needs a floating [..., out, in] tensor", got=(w.dtype, tuple(w.shape)))
    g = effective_group(w.shape[-1], group_size)
    x = w.float().reshape(*w.shape[:-1], -1, g)
    amax = x.abs().amax(dim=-1)
    scale = (amax / ((QMAX - QMIN) / 2)).to(scale_dtype or w.dtype)
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(x / s.unsqueeze(-1)).clamp(QMIN, QMAX).to(torch.int8).reshape(w.shape)
    return Int4Weight(q, scale, g)


def pack_ct(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> int32 [out, in/8], nibble i of word j = code[8j + i] + 8."""
    if q.shape[-1] % 8:
        raise CodecError("pack-quantized needs in-features divisible by 8", got=q.shape[-1])
    u = (q.to(torch.int32) - QMIN).reshape(*q.shape[:-1], -1, 8)
    out = torch.zeros(u.shape[:-1], dtype=torch.int32)
    for i in range(8):
        out |= u[..., i] << (4 * i)
    return out


def unpack_ct(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    parts = [((packed >> (4 * i)) & 0xF) for i in range(8)]
    return (torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)[..., :in_features] + QMIN).to(torch.int8)


def pack_awq(w4: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight I32 [in, out/8], qzeros I32 [in/g, out/8], scales F16 [in/g, out]) for one matrix."""
    q = w4.q
    out_f, in_f = q.shape
    if out_f % 8:
        raise CodecError("AutoAWQ GEMM needs out-features divisible by 8", got=out_f)
    u = (q.to(torch.int32) - QMIN).t().contiguous().reshape(in_f, out_f // 8, 8)
    qweight = torch.zeros((in_f, out_f // 8), dtype=torch.int32)
    for slot, col in enumerate(AWQ_ORDER):
        qweight |= u[..., col] << (4 * slot)
    n_groups = in_f // w4.group
    zeros = torch.full((n_groups, out_f // 8, 8), -QMIN, dtype=torch.int32)
    qzeros = torch.zeros((n_groups, out_f // 8), dtype=torch.int32)
    for slot, col in enumerate(AWQ_ORDER):
        qzeros |= zeros[..., col] << (4 * slot)
    scales = w4.scale.t().contiguous().to(torch.float16)
    return qweight, qzeros, scales


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Dense [out, in] from the AutoAWQ GEMM tensors (inverse of pack_awq)."""
    in_f, cols = qweight.shape
    w = torch.zeros((in_f, cols, 8), dtype=torch.int32)
    z = torch.zeros((qzeros.shape[0], cols, 8), dtype=torch.int32)
    for slot, col in enumerate(AWQ_ORDER):
        w[..., col] = (qweight >> (4 * slot)) & 0xF
        z[..., col] = (qzeros >> (4 * slot)) & 0xF
    w = w.reshape(in_f, -1)
    z = z.reshape(qzeros.shape[0], -1)
    g = in_f // scales.shape[0]
    deq = (w - z.repeat_interleave(g, dim=0)).float() * scales.float().repeat_interleave(g, dim=0)
    return deq.t().contiguous().to(dtype)


def awq_down_scales(x: torch.Tensor, w_down: torch.Tensor, group_size: int, grid: int) -> tuple[torch.Tensor, float, float, float]:
    """Best per-input-channel scale s [I] for down_proj (W [H, I]) given activations x [n, I].

    Returns (s, best_alpha, best_mse, rtn_mse); s = 1 (alpha 0) when x is empty."""
    n_in = w_down.shape[-1]
    if x.numel() == 0:
        return torch.ones(n_in), 0.0, 0.0, 0.0
    xf = x.float()
    wf = w_down.float()
    ref = xf @ wf.t()
    x_mean = xf.abs().mean(dim=0)
    best = (None, 0.0, float("inf"))
    rtn = float("nan")
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = quantize((wf * s).to(w_down.dtype), group_size).dequantize(torch.float32)
        err = float(((xf / s) @ wq.t() - ref).pow(2).mean())
        if i == 0:
            rtn = err
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], best[2], rtn
