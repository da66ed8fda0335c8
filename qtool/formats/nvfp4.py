"""NVFP4 weight codec: E2M1 codes in 16-element blocks, FP8-E4M3 block scales, one FP32 global scale.

Numerics follow ModelOpt exactly (NVIDIA/Model-Optimizer
`modelopt/torch/quantization/qtensor/nvfp4_tensor.py`, `NVFP4QTensor.quantize` and
`get_weights_scaling_factor`), so that a weight we quantize is bit-identical to what ModelOpt's export
writes for the same amax:

    weight_scale_2 = amax(W) / (6 * 448)                                 float32
    block_scale    = e4m3( clamp(block_amax / (6 * weight_scale_2), 2**-9, 448) )   (0 -> 1.0 first)
    code           = round_to_nearest_e2m1( W / (float(block_scale) * weight_scale_2) )

Rounding is round-to-nearest, ties to the EVEN E2M1 code (0.25->0, 0.75->1, 1.25->1, 1.75->2,
2.5->2, 3.5->4, 5->4), which is what ModelOpt's `_cast_fp4` (searchsorted + odd-bound adjustment) and
compressed-tensors' `cast_to_fp4` both do; magnitudes above 6 saturate to 6. Packing puts the EVEN
element in the LOW nibble (`packed = q[..., 1::2] << 4 | q[..., 0::2]`, same file).

Leading dims (stacked experts: [E, out, in]) are quantized independently: one weight_scale_2 per
[out, in] matrix, shape W.shape[:-2]. Everything is vectorised and runs on the tensors' device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from qtool.formats import CodecError
from qtool.lazy import lazy_module

torch = lazy_module("torch")

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Four-over-six normalises block scales to 256 instead of 448, so that a block scaled to map its max to 4
# (1.5x the max-to-6 scale) still fits E4M3: 256 * 1.5 = 384 <= 448 (ModelOpt 0.47
# modelopt/torch/quantization/utils/numeric_utils.py `E4M3_MAX_46`, `fp8_max_for_normalization`).
E4M3_MAX_FOUR_OVER_SIX = 256.0
# Smallest positive float8_e4m3fn (subnormal 2**-9); ModelOpt clamps block scales into [2**-9, 448]
# so a tiny block never underflows to a zero scale (nvfp4_tensor.py `_cast_per_block_scale_to_fp8`).
E4M3_MIN_SCALE = 2.0**-9

# Code -> value, code = sign << 3 | magnitude index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Midpoints between neighbouring magnitudes. A value equal to a midpoint goes to the neighbour with
# the even code: down at 0.25/1.25/2.5/5 (strict >), up at 0.75/1.75/3.5 (>=).
_ROUND_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_AT_TIE = (0.75, 1.75, 3.5)

# Rows of [*, in] processed per step: keeps the float32 temporaries in cache-sized pieces, which on a
# CPU is ~2x faster than whole-tensor ops and bounds peak memory for large stacked experts.
_CHUNK_ELEMS = 1 << 18


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4-quantized weight (or a stack of them along leading dims)."""

    packed: torch.Tensor  # uint8 [..., out, in/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., out, in/16]
    weight_scale_2: torch.Tensor  # float32 [...] (a 0-d scalar for a single matrix)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the unquantized weight."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.packed, self.block_scale, self.weight_scale_2, dtype=dtype)


def fp8_scale_bytes(device: torch.device | str = "cpu") -> torch.Tensor:
    """The bytes of the 126 finite positive float8_e4m3fn values, ascending (the block scales a per-block
    scale search tries: qtool.ops.quantize.nvfp4_mse). Made once per device and shared (do not modify it):
    GPTQ's column loop asks for it at every block, and its boolean selection would wait for the GPU there."""
    return _fp8_scale_bytes_on(str(torch.device(device)))


@functools.cache
def _fp8_scale_bytes_on(device: str) -> torch.Tensor:
    values = torch.arange(0, 128, dtype=torch.uint8)
    as_float = values.view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(as_float) & (as_float > 0)].to(device)


# Which candidates a block's scale sweep has to try (qtool.ops.quantize.nvfp4_mse.sweep_block_scales and its
# Triton kernel). Candidate k (of fp8_scale_bytes, ascending) scales a block by s_k = c_k * amax / 6, its
# loss L(s) = sum_i dist(|x_i|, G(s))^2 with G(s) = s * {0, .5, 1, 1.5, 2, 3, 4, 6} (round to nearest; a value
# above 6s saturates to 6s, its nearest point too), and the sweep keeps the FIRST smallest loss. Let a be the
# block max and k_c the first candidate with 6 * s_k >= a. Exact arithmetic; the kernel's own float rounding
# (~1e-7 relative) is far inside both margins below.
# - Above: a candidate k >= max(k_c + SWEEP_ABOVE, SWEEP_FIRST_HALVABLE) never wins. Eight steps up at least
#   double a candidate (8 per octave among normals, fewer among subnormals), and s_{k_c+1} > a / 6, so
#   s_k >= a / 3: every |x_i| <= 3 s_k, whose nearest point in G(s_k) lies in s_k * {0, .5, 1, 1.5, 2, 3},
#   a subset of G(s_k / 2) = s_k * {0, .25, .5, .75, 1, 1.5, 2, 3}. So L(s_k / 2) <= L(s_k), and s_k / 2 is a
#   candidate (index >= 15, byte >= 16: halving is exact in E4M3, and exact in float32 through
#   c / 448 * amax / 6) that comes first: s_k is never the first smallest.
# - Below: a candidate k < k_c - SWEEP_BELOW never wins. Then k_c >= 24 is a normal E4M3 value, so
#   s_{k_c} <= 1.125 a / 6 (normals are at most 12.5 % apart) and s_k <= s_{k_c} / 8 (three octaves down).
#   Every |x_i| <= 6 s_{k_c} is within s_{k_c} of G(s_{k_c}) (the widest gap, 4 to 6, is 2): L(s_{k_c}) <=
#   16 s_{k_c}^2 <= 0.5625 a^2, while the block max saturates under s_k: L(s_k) >= (a - 6 s_k)^2 >=
#   (1 - 6 * 1.125 / 48)^2 a^2 = 0.738 a^2 > L(s_{k_c}).
# So each block tries at most SWEEP_BELOW + SWEEP_ABOVE = 33 of the 126 candidates, in ascending order.
SWEEP_BELOW = 24
SWEEP_ABOVE = 9
SWEEP_FIRST_HALVABLE = 15


def sweep_window(six_scales: torch.Tensor, block_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) candidate index each block's scale sweep tries, int64 like block_amax's shape.

    six_scales [R, NC]: 6 * s_k of each row's candidates, ascending; block_amax [R, nb]."""
    k_c = torch.searchsorted(six_scales.contiguous(), block_amax.contiguous(), side="left")  # first 6 s_k >= a
    n = six_scales.shape[-1]
    first = (k_c - SWEEP_BELOW).clamp(min=0)
    last = (k_c + SWEEP_ABOVE).clamp(min=SWEEP_FIRST_HALVABLE, max=n) - 1
    return first, last


def weight_scale_2_from_amax(amax: torch.Tensor | float, fp8_max: float = E4M3_MAX) -> torch.Tensor:
    """Global weight scale: amax / (6 * fp8_max), float32 (ModelOpt `get_weights_scaling_factor_2_from_quantizer`;
    fp8_max is 448, or 256 for four-over-six)."""
    return torch.as_tensor(amax).float() / (E2M1_MAX * fp8_max)


def input_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Static activation scale `input_scale` = amax(x) / (6 * 448), float32 (same formula as weights)."""
    return weight_scale_2_from_amax(amax)


def matrix_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| over the last two dims, as float32 of shape w.shape[:-2]."""
    return torch.maximum(w.amax(dim=(-2, -1)), -w.amin(dim=(-2, -1))).float()


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled float values to E2M1 codes (uint8, sign in bit 3), ties to even code.

    Sign comes from `x < 0` as in ModelOpt: -0.0 encodes as +0 (code 0), a small negative value that
    rounds to zero as -0 (code 8).
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for b in _ROUND_UP_STRICT:
        code += a > b
    for b in _ROUND_UP_AT_TIE:
        code += a >= b
    code |= (x < 0).to(torch.uint8) << 3
    return code


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n/2] bytes, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise CodecError("E2M1 packing needs an even last dimension", expected="even", got=codes.shape[-1])
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] codes (uint8); inverse of `pack`."""
    if packed.dtype != torch.uint8:
        raise CodecError("packed NVFP4 weight must be uint8", expected=torch.uint8, got=packed.dtype)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def check_weight(w: torch.Tensor) -> None:
    if w.ndim < 2 or not w.is_floating_point():
        raise CodecError("NVFP4 quantize needs a floating [..., out, in] tensor", got=(w.dtype, tuple(w.shape)))
    if w.shape[-1] % BLOCK_SIZE:
        raise CodecError(
            "NVFP4 needs in-features divisible by the block size",
            expected=f"multiple of {BLOCK_SIZE}",
            got=w.shape[-1],
            hint="exclude this module from NVFP4 quantization (keep it BF16)",
        )


def _as_matrix_scale(ws2: torch.Tensor) -> torch.Tensor:
    """A single global scale may arrive as [] or [1] (compressed-tensors stores [1]); use []."""
    return ws2.reshape(()) if ws2.numel() == 1 else ws2


def _row_ws2(ws2: torch.Tensor, lead: tuple[int, ...], out: int) -> torch.Tensor:
    """Per-matrix scale [*lead] -> one value per row of the flattened [R, in] view, shape [R, 1]."""
    return ws2.expand(lead).reshape(-1, 1).repeat_interleave(out, dim=0)


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim (16) of float32 blocks, as a tree of elementwise maxima.

    Exact (max is exact) and several times faster on CPU than amax(-1) over a 16-wide inner dim.
    """
    m = blocks.abs()
    while m.shape[-1] > 1:
        half = m.shape[-1] // 2
        m = torch.maximum(m[..., :half], m[..., half:])
    return m.squeeze(-1)


def _scales_from_block_amax(block_amax: torch.Tensor, row_ws2: torch.Tensor) -> torch.Tensor:
    scale = block_amax / (E2M1_MAX * row_ws2)
    # An all-zero block gets scale 1.0 (ModelOpt: `per_block_scale[per_block_scale == 0] = 1.0`).
    # NaN only arises from an all-zero matrix (0 / 0); ModelOpt would emit NaN scales there, we emit 1.0
    # so the checkpoint stays finite (codes are 0 and weight_scale_2 is 0 either way).
    scale = torch.where((scale == 0) | scale.isnan(), torch.ones_like(scale), scale)
    return scale.clamp(E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)


def block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor | float) -> torch.Tensor:
    """FP8 E4M3 per-16-element block scales [..., out, in/16] for w given per-matrix weight_scale_2."""
    check_weight(w)
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    ws2 = _as_matrix_scale(torch.as_tensor(weight_scale_2, device=w.device).float())
    block_amax = _block_amax(w.reshape(-1, n_in // BLOCK_SIZE, BLOCK_SIZE).float())
    return _scales_from_block_amax(block_amax, _row_ws2(ws2, lead, out)).reshape(*lead, out, -1)


def quantize(
    w: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    weight_scale_2: torch.Tensor | float | None = None,
    block_scale: torch.Tensor | None = None,
) -> NVFP4Weight:
    """Quantize w [..., out, in] (bf16/fp16/fp32) to NVFP4 with round-to-nearest.

    global_amax / weight_scale_2 (at most one; a scalar or shape w.shape[:-2]) override the per-matrix
    amax, e.g. to share one scale between gate and up. block_scale (float8_e4m3fn [..., out, in/16])
    overrides the block scales, e.g. to re-encode with scales from another tool.
    """
    check_weight(w)
    if global_amax is not None and weight_scale_2 is not None:
        raise CodecError("pass global_amax or weight_scale_2, not both")
    lead, out, n_in = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    nb = n_in // BLOCK_SIZE
    if weight_scale_2 is not None:
        ws2 = torch.as_tensor(weight_scale_2, device=w.device).float()
    else:
        amax = matrix_amax(w) if global_amax is None else torch.as_tensor(global_amax, device=w.device)
        ws2 = weight_scale_2_from_amax(amax)
    ws2 = _as_matrix_scale(ws2).expand(lead).contiguous()
    row_ws2 = _row_ws2(ws2, lead, out)
    rows = w.reshape(-1, nb, BLOCK_SIZE)
    if block_scale is None:
        scales = torch.empty(rows.shape[:2], dtype=torch.float8_e4m3fn, device=w.device)
    elif block_scale.shape == (*lead, out, nb) and block_scale.dtype == torch.float8_e4m3fn:
        scales = block_scale.reshape(-1, nb)
    else:
        raise CodecError(
            "block_scale does not fit the weight",
            expected=("float8_e4m3fn", (*lead, out, nb)),
            got=(block_scale.dtype, tuple(block_scale.shape)),
        )

    packed = torch.empty((rows.shape[0], n_in // 2), dtype=torch.uint8, device=w.device)
    step = max(1, _CHUNK_ELEMS // n_in)
    for r0 in range(0, rows.shape[0], step):
        r1 = min(r0 + step, rows.shape[0])
        x = rows[r0:r1].float()
        if block_scale is None:
            scales[r0:r1] = _scales_from_block_amax(_block_amax(x), row_ws2[r0:r1])
        # Divisor as ModelOpt forms it: float(e4m3 scale) * weight_scale_2 in float32, then x / divisor.
        denom = scales[r0:r1].float() * row_ws2[r0:r1]
        packed[r0:r1] = pack(encode_e2m1(x / denom.unsqueeze(-1)).reshape(-1, n_in))
    return NVFP4Weight(packed.reshape(*lead, out, n_in // 2), scales.reshape(*lead, out, nb), ws2)


def shared_weight_scale_2(*weights: torch.Tensor) -> torch.Tensor:
    """One weight_scale_2 per matrix covering several weights: max of their amaxes / (6*448).

    ModelOpt unifies fused linears the same way (export/quant_utils.py `preprocess_linear_fusion`:
    max of the weight amaxes), and vLLM needs equal w1/w3 scales (it fuses gate+up into w13 and warns
    or mis-scales otherwise: model_executor/layers/quantization/modelopt.py).
    """
    amax = torch.stack([matrix_amax(w) for w in weights]).amax(dim=0)
    return weight_scale_2_from_amax(amax)


def quantize_gate_up(gate: torch.Tensor, up: torch.Tensor) -> tuple[NVFP4Weight, NVFP4Weight]:
    """Quantize gate_proj and up_proj of an expert (or a stack of experts) with one shared scale."""
    ws2 = shared_weight_scale_2(gate, up)
    return quantize(gate, weight_scale_2=ws2), quantize(up, weight_scale_2=ws2)


def dequantize(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """e2m1[code] * (float(block_scale) * weight_scale_2), in float32, cast to dtype (bfloat16 when None) at
    the end.

    Same order of operations as ModelOpt's `NVFP4QTensor.dequantize` (non-fast path).
    """
    codes = unpack(packed)
    n_in = codes.shape[-1]
    if block_scale.shape != (*codes.shape[:-1], n_in // BLOCK_SIZE):
        raise CodecError(
            "NVFP4 block scale shape does not match the packed weight",
            expected=(*codes.shape[:-1], n_in // BLOCK_SIZE),
            got=tuple(block_scale.shape),
        )
    ws2 = _as_matrix_scale(torch.as_tensor(weight_scale_2, device=packed.device).float())
    ws2 = ws2.reshape(*ws2.shape, 1, 1)
    scale = block_scale.float() * ws2
    values = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, BLOCK_SIZE) * scale.unsqueeze(-1)
    return values.reshape(codes.shape).to(torch.bfloat16 if dtype is None else dtype)
