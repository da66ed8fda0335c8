"""The architecture map of an opened checkpoint: every tensor classified, grouped into modules, each
module's storage format, the routed-expert layout, full-attention layers and KV scales.

Built from headers and configs only; the few KV-scale scalars are the only data read (8 bytes each).
"""

from __future__ import annotations

import gc
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum

from qtool.arch.qwen35 import (
    FUSED_EXPERT_PARAMS,
    KV_SCALE_PARAMS,
    Group,
    Naming,
    TensorRole,
    classify,
    detect_naming,
    full_attention_layers,
    layer_types,
)
from qtool.io.checkpoint import Checkpoint
from qtool.formats.naming import REQUIRED_PARAMS as CODEC_REQUIRED_PARAMS
from qtool.formats.naming import QuantFormat, detect_format
from qtool.io.dtypes import FLOAT_DTYPES
from qtool.io.safetensors_header import TensorInfo


class Format(str, Enum):
    BF16 = "bf16"  # also f16 / f32: unquantized
    NVFP4 = "nvfp4"  # ModelOpt names: weight U8 + weight_scale F8 + weight_scale_2
    NVFP4_CT = "nvfp4-ct"  # compressed-tensors: weight_packed U8 + weight_global_scale
    FP8 = "fp8"
    AWQ = "awq"  # AutoAWQ GEMM: qweight/qzeros/scales
    INT4_CT = "int4-ct"  # compressed-tensors pack-quantized: weight_packed I32


QUANTIZED_FORMATS = frozenset({Format.NVFP4, Format.NVFP4_CT, Format.FP8, Format.AWQ, Format.INT4_CT})

# qtool.formats.naming knows every storage format by its parameter names and dtypes; the architecture
# map only distinguishes what the engines and the operations act on.
_FROM_CODEC: dict[QuantFormat, Format] = {
    QuantFormat.BF16: Format.BF16,
    QuantFormat.FP16: Format.BF16,
    QuantFormat.FP32: Format.BF16,
    QuantFormat.NVFP4: Format.NVFP4,
    QuantFormat.NVFP4_CT: Format.NVFP4_CT,
    QuantFormat.FP8: Format.FP8,
    QuantFormat.FP8_BLOCK: Format.FP8,
    QuantFormat.AWQ: Format.AWQ,
    QuantFormat.INT4_CT: Format.INT4_CT,
}

# The tensors each quantized format needs next to its packed weight.
REQUIRED_PARAMS: dict[Format, tuple[str, ...]] = {
    fmt: tuple(sorted(CODEC_REQUIRED_PARAMS[q]))
    for q, fmt in _FROM_CODEC.items()
    if fmt in QUANTIZED_FORMATS and q is not QuantFormat.FP8_BLOCK  # per-tensor FP8 is the base form
}


_NO_FORMAT = object()
_FORMAT_BY_SIGNATURE: dict[tuple, object] = {}


def module_format(params: dict[str, TensorInfo]) -> Format | None:
    """Storage format of one module's weight matrix, from its parameter names and dtypes; None for
    modules without a matrix (norms, biases, A_log, scalars)."""
    w = params.get("weight")
    # Only 2-D weights are Linears an engine may quantize (conv1d [C,1,K] and the vision patch
    # embedding's 5-D conv weight are not).
    if w is not None and len(w.shape) != 2:
        return None
    if w is not None or "weight_packed" in params or "qweight" in params:
        # ~95k modules in a 397B checkpoint share a handful of (param, dtype) signatures.
        key = tuple((k, t.dtype) for k, t in params.items())
        fmt = _FORMAT_BY_SIGNATURE.get(key)
        if fmt is None:
            fmt = _FORMAT_BY_SIGNATURE[key] = _FROM_CODEC.get(detect_format(dict(key)), _NO_FORMAT)
        return None if fmt is _NO_FORMAT else fmt
    for p in FUSED_EXPERT_PARAMS:  # fused 3-D routed experts: experts.gate_up_proj / experts.down_proj
        t = params.get(p)
        if t is not None and len(t.shape) == 3 and t.dtype in FLOAT_DTYPES:
            return Format.BF16
    return None


@dataclass
class Module:
    name: str
    group: Group
    inner: Group
    layer: int | None
    expert: int | None
    params: dict[str, TensorInfo] = field(default_factory=dict)
    format: Format | None = None

    @property
    def is_mtp(self) -> bool:
        return self.group is Group.MTP


@dataclass
class KvScales:
    layers: list[int]  # full-attention layers that have both k and v scales
    naming: str | None  # "modelopt" (self_attn.k_proj.k_scale) | "compressed-tensors" (self_attn.k_scale)
    calibrated: bool | None  # False when every scale is the constant 1.0 (fp8_cast recipes)
    values: dict[int, tuple[float, float]]  # layer -> (k_scale, v_scale)
    invalid: list[str]  # tensors whose value is not a finite positive number


@dataclass
class ModelMap:
    ckpt: Checkpoint
    naming: Naming
    roles: dict[str, TensorRole]
    modules: dict[str, Module]
    layer_types: list[str]
    full_attention: list[int]
    expert_layout: str | None  # fused | per_expert | mixed | None (over the decoder layers)
    layer_expert_layout: dict[int, str]  # per decoder layer
    mtp_expert_layout: str | None
    kv: KvScales

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def modules_in(self, group: Group) -> list[Module]:
        return [m for m in self.modules.values() if m.group is group]

    def read_kv_values(self) -> None:
        """(Re)read the KV scale values (for a map built with read_values=False)."""
        self.kv = _kv_scales(self.ckpt, self.roles, self.full_attention, read_values=True)

    def group_formats(self) -> dict[Group, str]:
        """group -> storage format of its matrices ("mixed" when they differ), in one pass."""
        seen: dict[Group, set[Format]] = defaultdict(set)
        for m in self.modules.values():
            if m.format is not None:
                seen[m.group].add(m.format)
        return {g: next(iter(f)).value if len(f) == 1 else "mixed" for g, f in seen.items()}

    def group_format(self, group: Group) -> str | None:
        formats = {m.format for m in self.modules.values() if m.group is group and m.format is not None}
        if not formats:
            return None
        return next(iter(formats)).value if len(formats) == 1 else "mixed"


def _layout(kinds: set[str]) -> str | None:
    if not kinds:
        return None
    return next(iter(kinds)) if len(kinds) == 1 else "mixed"


def build_map(ckpt: Checkpoint, *, read_values: bool = True) -> ModelMap:
    """The checkpoint's modules and roles. Everything comes from headers except the KV scale values
    (`kv.values`, `kv.calibrated`, `kv.invalid`); `read_values=False` leaves those empty, for shards whose
    data is still being written (then call `read_kv_values` once it is)."""
    # Same reason as in Checkpoint.open: hundreds of thousands of acyclic objects.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_map(ckpt, read_values)
    finally:
        if gc_was_enabled:
            gc.enable()


def _build_map(ckpt: Checkpoint, read_values: bool = True) -> ModelMap:
    naming = detect_naming(ckpt.tensors)
    roles: dict[str, TensorRole] = {}
    modules: dict[str, Module] = {}
    # one str per distinct parameter name ("weight", "weight_scale", ...) instead of one per tensor, and
    # the module's own name in every role of the module: ~50 MB less for a 397B checkpoint
    param_names: dict[str, str] = {}
    for name, info in ckpt.tensors.items():
        module_name, _, param = name.rpartition(".")
        param = param_names.setdefault(param, param)
        is_kv = param in KV_SCALE_PARAMS
        mod = modules.get(module_name)
        if mod is None:
            # Classify once per module (an NVFP4 expert Linear has 4 tensors). A module's role comes
            # from the module name; KV scales (k_proj.k_scale) are roles of their own tensors only.
            r = classify(module_name + ".weight" if is_kv else name, naming)
            mod = modules[module_name] = Module(module_name, r.group, r.inner, r.layer, r.expert)
        if is_kv:
            roles[name] = classify(name, naming)
        else:
            roles[name] = TensorRole(mod.group, mod.inner, mod.name, param, mod.layer, mod.expert)
        mod.params[param] = info
    for mod in modules.values():
        mod.format = module_format(mod.params)

    text_cfg = ckpt.text_config
    types = layer_types(text_cfg) if text_cfg else []
    full = full_attention_layers(text_cfg) if text_cfg else []

    per_layer: dict[int, set[str]] = defaultdict(set)
    mtp_kinds: set[str] = set()
    for mod in modules.values():
        if mod.inner is not Group.ROUTED_EXPERTS or mod.layer is None:
            continue
        kind = "per_expert" if mod.expert is not None else "fused"
        (mtp_kinds if mod.is_mtp else per_layer[mod.layer]).add(kind)
    layer_layout = {layer: _layout(k) or "" for layer, k in sorted(per_layer.items())}
    overall = _layout(set().union(*per_layer.values())) if per_layer else None

    return ModelMap(
        ckpt, naming, roles, modules, types, full, overall, layer_layout, _layout(mtp_kinds),
        _kv_scales(ckpt, roles, full, read_values),
    )


def _kv_scales(ckpt: Checkpoint, roles: dict[str, TensorRole], full: list[int], read_values: bool = True) -> KvScales:
    from qtool.io.reader import read_scalar

    found: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    namings: Counter[str] = Counter()
    for name, role in roles.items():
        if role.group is not Group.KV_SCALE or role.layer is None:
            continue
        found[role.layer][role.param] = ckpt.tensors[name]
        namings["modelopt" if role.module.endswith(("k_proj", "v_proj")) else "compressed-tensors"] += 1
    layers = sorted(l for l, p in found.items() if "k_scale" in p and "v_scale" in p)
    values: dict[int, tuple[float, float]] = {}
    invalid: list[str] = []
    for layer in layers if read_values else []:
        pair = []
        for p in ("k_scale", "v_scale"):
            info = found[layer][p]
            try:
                v = read_scalar(info)
            except ValueError:
                v = float("nan")
            if not (math.isfinite(v) and v > 0):
                invalid.append(info.name)
            pair.append(v)
        values[layer] = (pair[0], pair[1])
    calibrated = None
    if values:
        flat = [v for kv in values.values() for v in kv]
        calibrated = not all(v == 1.0 for v in flat) and not invalid
    naming = namings.most_common(1)[0][0] if namings else None
    return KvScales(layers, naming, calibrated, values, invalid)
