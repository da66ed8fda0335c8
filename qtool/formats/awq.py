"""INT4 group quantization and its two storage forms: AutoAWQ GEMM and compressed-tensors pack-quantized.

In memory an `Int4Weight` holds UNSIGNED codes 0..15 with per-group scales and unsigned zero points
(symmetric: zero point 8, implicit), `w ~= (code - zero) * scale`. The stored forms:

AutoAWQ GEMM (AutoAWQ `awq/modules/linear/gemm.py` WQLinear_GEMM.from_linear; vLLM
`model_executor/layers/quantization/awq_triton.py` AWQ_REVERSE_ORDER):
    qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales fp16 [in/g, out]
    eight codes per int32 along OUT, nibble i (bits 4i..4i+3) holding element AWQ_ORDER[i] of the 8.

compressed-tensors pack-quantized (compressed_tensors/compressors/pack_quantized/{base,helpers}.py):
    weight_packed int32 [out, ceil(in/8)], element i of 8 at bits 4i, value = signed code + 8
    (which is our unsigned code); weight_scale [out, in/g]; weight_shape int64 [out, in];
    weight_zero_point (asymmetric only) = signed zero point packed the same way along OUT:
    int32 [ceil(out/8), in/g].

Quantization is RTN with compressed-tensors' conventions (quantization/utils/helpers.py
`calculate_qparams`): the range always includes 0; symmetric scale = amax / 7.5 with codes
clamp(round(w/s), -8, 7); asymmetric scale = (max - min) / 15, zero = clamp(round(-min/s), 0, 15).
torch.round is round-half-even in both. A module whose in-features are fewer than the group size
uses one group per row (the group is the whole row).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from qtool.formats import CodecError
from qtool.lazy import lazy_module

torch = lazy_module("torch")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds element AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # element j sits in nibble AWQ_REVERSE_ORDER[j]


@dataclass(frozen=True)
class Int4Weight:
    codes: torch.Tensor  # uint8 [..., out, in], 0..15
    scales: torch.Tensor  # [..., out, n_groups]
    zeros: torch.Tensor | None  # uint8 [..., out, n_groups], 0..15; None = symmetric (8)
    group_size: int

    def zero_points(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 8, dtype=torch.uint8, device=self.scales.device)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        g = self.group_size
        q = self.codes.float().unflatten(-1, (-1, g))
        z = self.zero_points().float().unsqueeze(-1)
        return ((q - z) * self.scales.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16 if dtype is None else dtype)


def expert_group_size(in_features: list[int], group_size: int) -> int:
    """The ONE group size for every projection of a MoE expert (gate/up: hidden in-features, down:
    intermediate): both engines build a fused MoE layer with a single scheme and refuse at model build
    with "All MoE projections need to have same quantization scheme but found multiple" (vLLM 0.33 and
    SGLang 0.5.23 compressed_tensors_moe.py). `group_size`, or the smallest projection's whole row when
    that is shorter, provided it divides every projection's in-features."""
    g = min(effective_group_size(i, group_size) for i in in_features)
    bad = [i for i in in_features if i % g]
    if bad:
        raise CodecError(
            "no single INT4 group size fits every projection of an expert",
            expected=f"a group size dividing {sorted(set(in_features))}",
            got=g,
            hint='the engines need one scheme for all MoE projections ("All MoE projections need to have same '
            'quantization scheme"): set int4.group_size in the recipe to a common divisor',
        )
    return g


def effective_group_size(in_features: int, group_size: int) -> int:
    """The group actually used: the whole row when in_features < group_size."""
    if in_features < group_size:
        return in_features
    if in_features % group_size:
        raise CodecError(
            "in-features not divisible by the group size",
            expected=f"multiple of {group_size}",
            got=in_features,
            hint="keep this module unquantized or pick a group size that divides it",
        )
    return group_size


def quantize(
    w: torch.Tensor,
    group_size: int = 128,
    *,
    symmetric: bool = False,
    scale_dtype: torch.dtype | None = None,
) -> Int4Weight:
    """RTN INT4 of w [..., out, in]. Scales are rounded to `scale_dtype` (fp16 for AWQ, the weight
    dtype for compressed-tensors; float32 when None) BEFORE codes are computed, so stored scales and codes agree."""
    if w.ndim < 2 or not w.is_floating_point():
        raise CodecError("INT4 quantize needs a floating [..., out, in] tensor", got=(w.dtype, tuple(w.shape)))
    g = effective_group_size(w.shape[-1], group_size)
    x = w.float().unflatten(-1, (-1, g))
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1).clamp(min=0)
    scale = torch.maximum(-lo, hi) / 7.5 if symmetric else (hi - lo) / 15.0
    scale = scale.to(torch.float32 if scale_dtype is None else scale_dtype)
    # zero range: any non-zero scale encodes it exactly (compressed-tensors uses dtype eps here)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    s = scale.float().unsqueeze(-1)
    if symmetric:
        codes = torch.round(x / s).clamp(-8, 7) + 8
        zeros = None
    else:
        z = torch.round(-lo / scale.float()).clamp(0, 15)
        codes = (torch.round(x / s) + z.unsqueeze(-1)).clamp(0, 15)
        zeros = z.to(torch.uint8)
    return Int4Weight(codes.flatten(-2).to(torch.uint8), scale, zeros, g)


# ------------------------------------------------------------------ int32 nibble packing


def pack_int32(codes: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[..., n] codes 0..15 -> int32 [..., ceil(n/8)]; nibble i holds element order[i] (default i).
    A ragged tail is zero-padded (as compressed-tensors `pack_to_int32` does).

    Packed a byte at a time: byte j of a word holds nibbles 2j (low) and 2j+1 (high), and the 4 bytes
    read as one int32 in the machine's byte order are the word. One byte per code moves through memory, not
    the eight of an int64 per code (a 397B layer's 6.4 G codes: ~0.3 TB of int64 temporaries and traffic,
    the largest step of AWQ's coding thread in the lent H100's timeline)."""
    n = codes.shape[-1]
    pad = -n % 8
    v = codes.to(torch.uint8)
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.unflatten(-1, (-1, 8))
    if order is not None:
        v = v[..., list(order)]
    word = (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()  # [..., words, 4]: byte j = nibbles 2j, 2j+1
    if sys.byteorder == "big":
        word = word.flip(-1).contiguous()  # the int32's low byte comes last in memory there
    return word.view(torch.int32).squeeze(-1)


def unpack_int32(packed: torch.Tensor, n: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., ceil(n/8)] -> uint8 codes [..., n]; inverse of `pack_int32` with the same order (a byte
    at a time as well: each word's 4 bytes, low nibble then high)."""
    if packed.dtype != torch.int32:
        raise CodecError("packed INT4 tensor must be int32", expected=torch.int32, got=packed.dtype)
    word = packed.unsqueeze(-1).view(torch.uint8)  # [..., words, 4]
    if sys.byteorder == "big":
        word = word.flip(-1)
    nib = torch.stack((word & 0xF, word >> 4), dim=-1).flatten(-2)  # [..., words, 8]: nibble i at i
    if order is not None:
        inverse = [0] * 8
        for i, j in enumerate(order):
            inverse[j] = i
        nib = nib[..., inverse]
    return nib.flatten(-2)[..., :n].contiguous()


# ------------------------------------------------------------------ AutoAWQ GEMM


def to_awq(q: Int4Weight) -> dict[str, torch.Tensor]:
    """{'qweight', 'qzeros', 'scales'} of AutoAWQ GEMM (out must be a multiple of 8)."""
    if q.codes.shape[-2] % 8:
        raise CodecError("AWQ GEMM needs out-features divisible by 8", got=q.codes.shape[-2])
    return {
        "qweight": pack_int32(q.codes.transpose(-1, -2), AWQ_ORDER),
        "qzeros": pack_int32(q.zero_points().transpose(-1, -2), AWQ_ORDER),
        "scales": q.scales.transpose(-1, -2).to(torch.float16).contiguous(),
    }


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """AutoAWQ GEMM tensors -> Int4Weight (group size = in / groups)."""
    n_in, out = qweight.shape[-2], scales.shape[-1]
    codes = unpack_int32(qweight, out, AWQ_ORDER).transpose(-1, -2).contiguous()
    zeros = unpack_int32(qzeros, out, AWQ_ORDER).transpose(-1, -2).contiguous()
    return Int4Weight(codes, scales.transpose(-1, -2).contiguous(), zeros, n_in // scales.shape[-2])


# ------------------------------------------------------------------ compressed-tensors pack-quantized


def to_compressed_tensors(q: Int4Weight, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{'weight_packed', 'weight_scale', 'weight_shape'[, 'weight_zero_point']} (pack-quantized)."""
    out = {
        "weight_packed": pack_int32(q.codes),
        "weight_scale": q.scales.to(torch.bfloat16 if scale_dtype is None else scale_dtype),
        "weight_shape": torch.tensor(q.codes.shape, dtype=torch.int64),
    }
    if q.zeros is not None:
        # signed zero point z - 8 packed with +8 offset along OUT == our unsigned zeros packed
        out["weight_zero_point"] = pack_int32(q.zeros.transpose(-1, -2)).transpose(-1, -2).contiguous()
    return out


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, ...],
    weight_zero_point: torch.Tensor | None = None,
) -> Int4Weight:
    shape = tuple(int(v) for v in (weight_shape.tolist() if torch.is_tensor(weight_shape) else weight_shape))
    out, n_in = shape[-2:]
    codes = unpack_int32(weight_packed, n_in)
    zeros = None
    if weight_zero_point is not None:
        zeros = unpack_int32(weight_zero_point.transpose(-1, -2), out).transpose(-1, -2).contiguous()
    return Int4Weight(codes, weight_scale, zeros, n_in // weight_scale.shape[-1])
