"""FP8 E4M3 codec: per-tensor, per-channel and 2-D block scales, plus FP8 KV-cache scales.

Convention (ModelOpt `modelopt/torch/quantization/qtensor/fp8_tensor.py`, compressed-tensors
float-quantized, and the `weight_scale_inv` of Qwen/DeepSeek FP8 releases alike): the stored scale
multiplies, `w ~= float(q) * scale`, and `scale = amax / 448`. Quantization divides in float32 and
casts with round-to-nearest-even; we clamp to +-448 first so a value a hair above amax cannot become
NaN (float8_e4m3fn has no infinity; torch maps out-of-range values to NaN).

KV-cache scales (docs/formats.md §3): `k_scale` / `v_scale` = amax / 448, float32 scalars.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtool.formats import CodecError

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class FP8Weight:
    weight: torch.Tensor  # float8_e4m3fn, same shape as the input
    scale: torch.Tensor  # float32: [...] per tensor, [..., out, 1] per channel, [..., out/bo, in/bi] block


def scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """amax / 448 as float32."""
    return torch.as_tensor(amax).float() / E4M3_MAX


def kv_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """FP8 KV-cache scale (k_scale / v_scale) = amax / 448, float32 (ModelOpt's calibrated value)."""
    return scale_from_amax(amax)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero tensor/row/block would give 0/0 = NaN codes; scale 1 encodes the zeros exactly.
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _check(w: torch.Tensor) -> None:
    if w.ndim < 2 or not w.is_floating_point():
        raise CodecError("FP8 quantize needs a floating [..., out, in] tensor", got=(w.dtype, tuple(w.shape)))


def quantize_per_tensor(w: torch.Tensor, *, scale: torch.Tensor | float | None = None) -> FP8Weight:
    """One scale per [out, in] matrix (shape w.shape[:-2]); `scale` overrides amax/448."""
    _check(w)
    if scale is None:
        amax = torch.maximum(w.amax(dim=(-2, -1)), -w.amin(dim=(-2, -1)))
        s = _safe(scale_from_amax(amax))
    else:
        s = torch.as_tensor(scale, device=w.device).float().expand(w.shape[:-2]).contiguous()
    return FP8Weight(_cast(w.float() / s[..., None, None]), s)


def quantize_per_channel(w: torch.Tensor) -> FP8Weight:
    """One scale per output row, shape [..., out, 1] (compressed-tensors channel strategy)."""
    _check(w)
    amax = torch.maximum(w.amax(dim=-1, keepdim=True), -w.amin(dim=-1, keepdim=True))
    s = _safe(scale_from_amax(amax))
    return FP8Weight(_cast(w.float() / s), s)


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> FP8Weight:
    """One scale per [bo, bi] tile, shape [..., ceil(out/bo), ceil(in/bi)]; edge tiles are partial
    (zero-padded for the amax, as ModelOpt's `reduce_block_padding` and DeepSeek-style FP8 do)."""
    _check(w)
    bo, bi = block
    out, n_in = w.shape[-2:]
    po, pi = -out % bo, -n_in % bi
    x = F.pad(w.float(), (0, pi, 0, po))
    tiles = x.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))  # [..., To, bo, Ti, bi]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., To, Ti]
    s = _safe(scale_from_amax(amax))
    q = _cast(tiles / s[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
    return FP8Weight(q[..., :out, :n_in].contiguous(), s)


def _expand_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    out, n_in = shape[-2:]
    if scale.ndim < len(shape) - 1 or scale.ndim == len(shape) - 2:
        return scale.reshape(*scale.shape, 1, 1)  # per tensor
    if scale.shape[-1] == 1 and scale.shape[-2] == out:
        return scale  # per channel
    to, ti = scale.shape[-2:]
    bo, bi = -(-out // to), -(-n_in // ti)
    full = scale.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return full[..., :out, :n_in]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float(q) * scale (scale per tensor, per channel [.., out, 1] or per block), cast to dtype."""
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CodecError("FP8 dequantize needs a float8 tensor", got=q.dtype)
    s = torch.as_tensor(scale, device=q.device).float()
    s = s.reshape(()) if s.numel() == 1 else s
    return (q.float() * _expand_scale(s, q.shape)).to(dtype)


def input_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Static FP8 activation scale (ModelOpt `input_scale`, compressed-tensors `input_scale`) = amax / 448,
    float32; an input that was never seen (amax 0) gets scale 1 rather than 0 (a zero scale divides by 0)."""
    return _safe(scale_from_amax(amax))


# Where each output format keeps a W8A8 per-tensor linear's scalars: ModelOpt writes 0-d tensors
# (modelopt/torch/export/unified_export_hf.py), compressed-tensors the strategy-TENSOR shape (1,)
# (compressed_tensors/quantization/lifecycle/initialize.py). The names are the same in both.
W8A8_PARAMS = ("input_scale", "weight", "weight_scale")


def w8a8_per_tensor(
    w: torch.Tensor, *, weight_amax: torch.Tensor | float, input_amax: torch.Tensor | float, scalar_shape=()
) -> dict[str, torch.Tensor]:
    """One linear [out, in] in FP8 W8A8 per tensor, by parameter name: `weight` (float8_e4m3fn), `weight_scale`
    = weight_amax / 448 and `input_scale` = input_amax / 448 (float32, shaped `scalar_shape`). `weight_amax`
    may exceed the matrix's own (linears that share an input share one scale, as ModelOpt's export unifies
    them: modelopt/torch/export/quant_utils.py preprocess_linear_fusion)."""
    scale = _safe(scale_from_amax(weight_amax)).to(w.device)
    x = w.float() / scale
    if w.dtype in (torch.bfloat16, torch.float16):
        # ModelOpt's export divides a BF16 weight by its float32 0-d scale in BF16 (torch keeps the tensor's
        # dtype: modelopt/torch/export/quant_utils.py to_quantized_weight), so the quotient is rounded to BF16
        # before FP8; the same double rounding gives its bytes
        x = x.to(w.dtype)
    return {
        "input_scale": input_scale_from_amax(input_amax).reshape(scalar_shape),
        "weight": _cast(x.float()),
        "weight_scale": scale.reshape(scalar_shape),
    }
