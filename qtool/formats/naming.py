"""Tensor naming of the quantization formats, as data, plus lossless NVFP4 flavour conversion.

Two NVFP4 flavours store the same bytes under different names (docs/formats.md §3-4):

    ModelOpt             compressed-tensors        relation
    weight          U8   weight_packed        U8    same bytes
    weight_scale    F8   weight_scale         F8    same bytes
    weight_scale_2  F32 []   weight_global_scale F32 [1]   reciprocal
    input_scale     F32 []   input_global_scale  F32 [1]   reciprocal

(compressed_tensors/entrypoints/convert/converters/modelopt_nvfp4.py does exactly rename + 1/x.)

The reciprocal is NOT an involution in float32: fl(1/fl(1/x)) != x for ~17% of float32 values
(measured in tests/formats/test_naming.py). `convert_nvfp4` therefore returns, next to the converted
tensors, the original values of every reciprocated tensor that would not survive the trip back;
passing them to the reverse conversion restores the exact original bits (it checks that they still
match the current values first, so stale originals are ignored).

This module does not import torch at import time (header-only commands use `detect_format`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Flavour(str, Enum):
    """The two checkpoint conventions qtool reads and writes (the one enum for them: convert's target,
    calibrate-kv's KV-scale naming, the engines' ignore-list schema)."""

    MODELOPT = "modelopt"  # quant_method "modelopt": fnmatch globs; self_attn.k_proj.k_scale
    COMPRESSED_TENSORS = "compressed-tensors"  # exact names and `re:` regexes; self_attn.k_scale


class QuantFormat(str, Enum):
    """How one Linear module's weight is stored."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    NVFP4 = "nvfp4"  # ModelOpt naming
    NVFP4_CT = "nvfp4-ct"  # compressed-tensors nvfp4-pack-quantized
    MXFP4_CT = "mxfp4-ct"  # compressed-tensors mxfp4-pack-quantized (uint8 E8M0 scales, no global)
    MXFP4 = "mxfp4"  # AMD Quark / OCP MX naming: uint8 `weight` (E2M1 pairs) + E8M0 `weight_scale` per 32
    FP8 = "fp8"  # per-tensor / per-channel `weight_scale` (ModelOpt and CT float-quantized agree)
    FP8_BLOCK = "fp8-block"  # `weight_scale_inv` 128x128 blocks (Qwen/DeepSeek FP8 releases)
    AWQ = "awq"  # AutoAWQ GEMM qweight/qzeros/scales
    GPTQ = "gptq"  # qweight/qzeros/scales + g_idx
    INT4_CT = "int4-ct"  # compressed-tensors pack-quantized (int32 weight_packed)
    INT8_CT = "int8-ct"  # compressed-tensors int-quantized (int8 weight)
    UNKNOWN = "unknown"


# Parameters a module must carry, per format (input/activation scales and zero points are optional:
# they depend on the scheme, e.g. W4A16 has no input_global_scale, symmetric INT4 has no zero point).
REQUIRED_PARAMS: dict[QuantFormat, frozenset[str]] = {
    QuantFormat.BF16: frozenset({"weight"}),
    QuantFormat.FP16: frozenset({"weight"}),
    QuantFormat.FP32: frozenset({"weight"}),
    QuantFormat.NVFP4: frozenset({"weight", "weight_scale", "weight_scale_2"}),
    QuantFormat.NVFP4_CT: frozenset({"weight_packed", "weight_scale", "weight_global_scale"}),
    QuantFormat.MXFP4_CT: frozenset({"weight_packed", "weight_scale"}),
    QuantFormat.MXFP4: frozenset({"weight", "weight_scale"}),
    QuantFormat.FP8: frozenset({"weight", "weight_scale"}),
    QuantFormat.FP8_BLOCK: frozenset({"weight", "weight_scale_inv"}),
    QuantFormat.AWQ: frozenset({"qweight", "qzeros", "scales"}),
    QuantFormat.GPTQ: frozenset({"qweight", "qzeros", "scales", "g_idx"}),
    QuantFormat.INT4_CT: frozenset({"weight_packed", "weight_scale", "weight_shape"}),
    QuantFormat.INT8_CT: frozenset({"weight", "weight_scale"}),
    QuantFormat.UNKNOWN: frozenset(),
}

# dtype spellings -> safetensors header names. Accepts torch dtypes, "torch.bfloat16", "bfloat16",
# and the header names themselves, so callers can pass either headers or live tensors.
_DTYPE_ALIASES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "half": "F16",
    "float32": "F32",
    "float": "F32",
    "float64": "F64",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int": "I32",
    "int64": "I64",
    "long": "I64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}


def dtype_name(dtype: Any) -> str:
    """Safetensors header name ("BF16", "U8", "F8_E4M3", ...) for a torch dtype or any spelling."""
    s = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(s.lower(), s.upper())


def split_param(name: str) -> tuple[str, str]:
    """'model.layers.0.mlp.down_proj.weight_scale' -> ('model.layers.0.mlp.down_proj', 'weight_scale')."""
    module, _, param = name.rpartition(".")
    return module, param


def group_by_module(dtypes: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """{full tensor name: dtype} -> {module: {param: dtype name}}."""
    out: dict[str, dict[str, str]] = {}
    for name, dt in dtypes.items():
        module, param = split_param(name)
        out.setdefault(module, {})[param] = dtype_name(dt)
    return out


_DENSE = {"BF16": QuantFormat.BF16, "F16": QuantFormat.FP16, "F32": QuantFormat.FP32}


def detect_format(params: Mapping[str, Any]) -> QuantFormat:
    """Storage format of ONE module from {param_name: dtype} (local names: 'weight', 'qweight', ...).

    Decides on the primary tensor's name and dtype; use `missing_params` to check completeness.
    """
    p = {k: dtype_name(v) for k, v in params.items()}
    if "qweight" in p:
        return QuantFormat.GPTQ if "g_idx" in p else QuantFormat.AWQ
    if "weight_packed" in p:
        if p["weight_packed"] == "I32":
            return QuantFormat.INT4_CT
        if p["weight_packed"] == "U8":
            if "weight_global_scale" not in p and p.get("weight_scale") in ("U8", "F8_E8M0"):
                return QuantFormat.MXFP4_CT
            return QuantFormat.NVFP4_CT
        return QuantFormat.UNKNOWN
    w = p.get("weight")
    if w is None:
        return QuantFormat.UNKNOWN
    if w == "U8":
        # ModelOpt NVFP4 packs E2M1 pairs into uint8 `weight` with an F8 block scale.
        if "weight_scale_2" in p or p.get("weight_scale") == "F8_E4M3":
            return QuantFormat.NVFP4
        if p.get("weight_scale") in ("U8", "F8_E8M0"):  # Quark MXFP4: E8M0 exponents, one per 32 values
            return QuantFormat.MXFP4
        return QuantFormat.UNKNOWN
    if w in ("F8_E4M3", "F8_E5M2"):
        return QuantFormat.FP8_BLOCK if "weight_scale_inv" in p else QuantFormat.FP8
    if w == "I8":
        return QuantFormat.INT8_CT if "weight_scale" in p else QuantFormat.UNKNOWN
    return _DENSE.get(w, QuantFormat.UNKNOWN)


def missing_params(fmt: QuantFormat, names: Iterable[str]) -> list[str]:
    """Required params of `fmt` absent from `names`, sorted."""
    return sorted(REQUIRED_PARAMS[fmt] - set(names))


# ------------------------------------------------------------------ NVFP4 flavours


@dataclass(frozen=True)
class NVFP4Naming:
    """Where one NVFP4 flavour keeps each tensor of a Linear module."""

    weight: str
    block_scale: str
    weight_global: str
    input_global: str
    reciprocal: bool  # global scales stored as 1/scale (compressed-tensors) rather than scale
    scalar_shape: tuple[int, ...]  # trailing shape of the global scales: () or (1,)
    # KV-cache scale owners relative to the attention module (ModelOpt: on k_proj / v_proj,
    # compressed-tensors: on the attention module itself). docs/formats.md §3-4.
    k_scale: str = field(default="k_proj.k_scale")
    v_scale: str = field(default="v_proj.v_scale")

    def kv_scale_names(self, attn_module: str) -> tuple[str, str]:
        """Full names of (k_scale, v_scale) for attention module `...self_attn`."""
        return f"{attn_module}.{self.k_scale}", f"{attn_module}.{self.v_scale}"


MODELOPT_NVFP4 = NVFP4Naming("weight", "weight_scale", "weight_scale_2", "input_scale", False, ())
CT_NVFP4 = NVFP4Naming(
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
    True,
    (1,),
    k_scale="k_scale",
    v_scale="v_scale",
)
NVFP4_NAMINGS: dict[QuantFormat, NVFP4Naming] = {QuantFormat.NVFP4: MODELOPT_NVFP4, QuantFormat.NVFP4_CT: CT_NVFP4}


@dataclass
class Converted:
    tensors: dict[str, torch.Tensor]
    # original values (keyed by their SOURCE param name) of reciprocated tensors whose reciprocal
    # does not invert exactly; feed back as `originals=` to the reverse conversion.
    originals: dict[str, torch.Tensor]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise float32 equality (distinguishes -0.0 and compares NaN payloads)."""
    import torch

    a32, b32 = a.float().reshape(-1), b.float().reshape(-1)
    return a32.shape == b32.shape and bool((a32.view(torch.int32) == b32.view(torch.int32)).all())


def _global(x: torch.Tensor, src: NVFP4Naming, dst: NVFP4Naming) -> torch.Tensor:
    lead = x.shape[: x.ndim - len(src.scalar_shape)]
    y = x.float()
    if src.reciprocal != dst.reciprocal:
        y = y.reciprocal()
    return y.reshape((*lead, *dst.scalar_shape))


def convert_nvfp4(
    tensors: Mapping[str, torch.Tensor],
    src: QuantFormat,
    dst: QuantFormat,
    *,
    originals: Mapping[str, torch.Tensor] | None = None,
) -> Converted:
    """Convert one module's tensors {param: tensor} between NVFP4 flavours; other params pass through.

    Packed weights and block scales are passed on as the same tensor objects (the bytes are
    identical). `originals` from a previous opposite conversion restore exact global-scale bits.
    """
    s, d = NVFP4_NAMINGS[src], NVFP4_NAMINGS[dst]
    rename = {s.weight: d.weight, s.block_scale: d.block_scale}
    scales = {s.weight_global: d.weight_global, s.input_global: d.input_global}
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in rename:
            out[rename[name]] = t
        elif name in scales:
            new = _global(t, s, d)
            orig = (originals or {}).get(scales[name])
            # A recorded original is used only if it still maps to the current value (not stale).
            if orig is not None and _same_bits(_global(orig, d, s), t):
                new = orig.float().reshape(new.shape)
            if not _same_bits(_global(new, d, s), t):
                kept[name] = t
            out[scales[name]] = new
        else:
            out[name] = t
    return Converted(out, kept)
