"""The architecture map of an opened checkpoint: every tensor classified, grouped into modules, each
module's storage format, the routed-expert layout, full-attention layers and KV scales.

Built from headers and configs only; the few KV-scale scalars are the only data read (8 bytes each).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from qtool.arch.qwen35 import (
    FUSED_EXPERT_PARAMS,
    KV_SCALE_PARAMS,
    TEXT_PREFIX,
    Group,
    Naming,
    TensorRole,
    classify,
    detect_naming,
    full_attention_layers,
    layer_types,
)
from qtool.errors import ConfigError
from qtool.formats.naming import REQUIRED_PARAMS as CODEC_REQUIRED_PARAMS
from qtool.formats.naming import QuantFormat, detect_format
from qtool.io.checkpoint import _REUSED, CONFIG_NAME, Checkpoint
from qtool.io.dtypes import FLOAT_DTYPES
from qtool.io.reader import read_floats
from qtool.io.safetensors_header import TensorInfo
from qtool.io.tensor_table import file_of, nbytes_of, no_cyclic_gc, tensor_rows


class Format(str, Enum):
    BF16 = "bf16"  # also f16 / f32: unquantized
    NVFP4 = "nvfp4"  # ModelOpt names: weight U8 + weight_scale F8 + weight_scale_2
    NVFP4_CT = "nvfp4-ct"  # compressed-tensors: weight_packed U8 + weight_global_scale
    FP8 = "fp8"
    AWQ = "awq"  # AutoAWQ GEMM: qweight/qzeros/scales
    INT4_CT = "int4-ct"  # compressed-tensors pack-quantized: weight_packed I32
    MXFP4 = "mxfp4"  # OCP MX FP4 (Quark `weight` / compressed-tensors `weight_packed`) + E8M0 scale per 32


QUANTIZED_FORMATS = frozenset({Format.NVFP4, Format.NVFP4_CT, Format.FP8, Format.AWQ, Format.INT4_CT, Format.MXFP4})

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
    QuantFormat.MXFP4: Format.MXFP4,
    QuantFormat.MXFP4_CT: Format.MXFP4,
}

# The tensors each quantized format needs next to its packed weight.
REQUIRED_PARAMS: dict[Format, tuple[str, ...]] = {
    fmt: tuple(sorted(CODEC_REQUIRED_PARAMS[q]))
    for q, fmt in _FROM_CODEC.items()
    # per-tensor FP8 is the base form; MXFP4's two namings share one map format (their own check in checks.py)
    if fmt in QUANTIZED_FORMATS and q not in (QuantFormat.FP8_BLOCK, QuantFormat.MXFP4_CT)
}
REQUIRED_PARAMS[Format.MXFP4] = ("weight_scale",)  # its matrix is `weight` (Quark) or `weight_packed` (CT)


_NO_FORMAT = object()
_FORMAT_BY_SIGNATURE: dict[tuple, object] = {}

# A module's signature: ((param, dtype, ndim), ...) in the order its tensors were seen. A 397B checkpoint
# has ~95k modules but a handful of signatures, so one shared tuple per distinct signature replaces a dict
# of TensorInfo per module.
Signature = tuple
_SIGNATURES: dict[tuple, tuple] = {}


def extend_signature(sig: Signature, param: str, dtype: str, ndim: int) -> Signature:
    new = sig + ((param, dtype, ndim),)
    return _SIGNATURES.setdefault(new, new)


def signature_of(params: Mapping[str, TensorInfo]) -> Signature:
    sig: Signature = ()
    for k, t in params.items():
        sig = extend_signature(sig, k, t.dtype, len(t.shape))
    return sig


def signature_format(sig: Signature) -> Format | None:
    """Storage format of one module's weight matrix, from its parameter names, dtypes and ranks; None for
    modules without a matrix (norms, biases, A_log, scalars)."""
    fmt = _FORMAT_BY_SIGNATURE.get(sig)
    if fmt is None:
        fmt = _FORMAT_BY_SIGNATURE[sig] = _signature_format(sig)
    return None if fmt is _NO_FORMAT else fmt


def _signature_format(sig: Signature):
    by_param = {p: (dtype, ndim) for p, dtype, ndim in sig}
    w = by_param.get("weight")
    # Only 2-D weights are Linears an engine may quantize (conv1d [C,1,K] and the vision patch
    # embedding's 5-D conv weight are not).
    if w is not None and w[1] != 2:
        return _NO_FORMAT
    if w is not None or "weight_packed" in by_param or "qweight" in by_param:
        return _FROM_CODEC.get(detect_format({p: d for p, (d, _) in by_param.items()}), _NO_FORMAT)
    for p in FUSED_EXPERT_PARAMS:  # fused 3-D routed experts: experts.gate_up_proj / experts.down_proj
        t = by_param.get(p)
        if t is not None and t[1] == 3 and t[0] in FLOAT_DTYPES:
            return Format.BF16
    return _NO_FORMAT


def module_format(params: Mapping[str, TensorInfo]) -> Format | None:
    """Storage format of a module given its parameters (name -> anything with .dtype and .shape)."""
    return signature_format(signature_of(params))


@dataclass(slots=True, eq=False)
class Module:
    name: str
    group: Group
    inner: Group
    layer: int | None
    expert: int | None
    signature: Signature = ()
    format: Format | None = None
    tensors: Mapping[str, TensorInfo] | None = field(default=None, repr=False)  # the checkpoint's, for `params`

    @property
    def params(self) -> ModuleParams:
        """param -> TensorInfo, each made when looked up (a map keeps no TensorInfo per tensor)."""
        return ModuleParams(self)

    @property
    def param_names(self) -> frozenset[str]:
        names = _PARAM_NAMES.get(self.signature)
        if names is None:
            names = _PARAM_NAMES[self.signature] = frozenset(p for p, _, _ in self.signature)
        return names

    def param_name(self, param: str) -> str:
        """The tensor name of one of the module's parameters (a module with the empty name: the param's)."""
        return f"{self.name}.{param}" if self.name else param

    def param_nbytes(self, param: str) -> int:
        """One parameter's byte count, straight from the tensor table's columns where there is one."""
        return nbytes_of(self.tensors, self.param_name(param))

    def param_file(self, param: str) -> str:
        """One parameter's shard file, straight from the tensor table's columns where there is one."""
        return file_of(self.tensors, self.param_name(param))

    def nbytes(self) -> int:
        # verify's memory fit, the layer grid and the memory plan ask for every module's size (~95k modules,
        # ~370k tensors in a 397B checkpoint): no TensorInfo made
        return sum(self.param_nbytes(p) for p in self.param_names)

    @property
    def is_mtp(self) -> bool:
        return self.group is Group.MTP


_PARAM_NAMES: dict[tuple, frozenset[str]] = {}


class ModuleParams(Mapping):
    """A module's parameters as param -> TensorInfo; membership and names come from its signature, a
    TensorInfo is made only for the parameter looked up (checks look at 2-3 of a module's 4, for ~95k
    modules of a 397B checkpoint)."""

    __slots__ = ("_module",)

    def __init__(self, module: Module) -> None:
        self._module = module

    def __getitem__(self, param: str) -> TensorInfo:
        if param not in self._module.param_names:
            raise KeyError(param)
        return self._module.tensors[self._module.param_name(param)]

    def get(self, param: str, default=None):
        return self[param] if param in self._module.param_names else default

    def __contains__(self, param) -> bool:
        return param in self._module.param_names

    def __iter__(self):
        return (p for p, _, _ in self._module.signature)

    def __len__(self) -> int:
        return len(self._module.signature)


class RoleMap(Mapping):
    """tensor name -> TensorRole, made on demand from the tensor's module (KV scales have roles of their
    own). Iterates in the checkpoint's order."""

    __slots__ = ("_tensors", "_modules", "_kv")

    def __init__(self, tensors: Mapping, modules: dict[str, Module], kv: dict[str, TensorRole]) -> None:
        self._tensors, self._modules, self._kv = tensors, modules, kv

    def _role(self, name: str) -> TensorRole:
        r = self._kv.get(name)
        if r is not None:
            return r
        module, _, param = name.rpartition(".")
        m = self._modules[module]
        return TensorRole(m.group, m.inner, m.name, param, m.layer, m.expert)

    def __getitem__(self, name: str) -> TensorRole:
        if name not in self._tensors:
            raise KeyError(name)
        return self._role(name)

    def get(self, name: str, default=None):
        return self._role(name) if name in self._tensors else default

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def items(self):
        role = self._role
        return ((n, role(n)) for n in self._tensors)

    def kv_roles(self):
        """(name, role) of the tensors whose param is a KV scale (their roles are kept, not made)."""
        return self._kv.items()

    def values(self):
        role = self._role
        return (role(n) for n in self._tensors)


@dataclass
class KvScales:
    layers: list[int]  # full-attention layers that have both k and v scales
    naming: str | None  # "modelopt" (self_attn.k_proj.k_scale) | "compressed-tensors" (self_attn.k_scale)
    calibrated: bool | None  # False when every scale is the constant 1.0 (fp8_cast recipes)
    values: dict[int, tuple[float, float]]  # layer -> (k_scale, v_scale); per-head scales: the largest head's
    invalid: list[str]  # tensors whose value is not a finite positive number
    per_head: bool = False  # [num_kv_heads] scales (compressed-tensors `strategy: attn_head`), not scalars


@dataclass
class ModelMap:
    ckpt: Checkpoint
    naming: Naming
    roles: RoleMap  # name -> TensorRole
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

    def kv_scale_tensors(self) -> list[str]:
        """The KV-scale tensors' names (k_scale / v_scale), sorted: from the few roles the map keeps for
        them, not a role made for each of the 397B's ~370k tensors."""
        return sorted(n for n, r in self.roles.kv_roles() if r.group is Group.KV_SCALE)

    def has_group(self, group: Group) -> bool:
        """Whether any tensor has a role in `group` (a tensor takes its module's group, a KV scale has a
        role of its own)."""
        return any(m.group is group and not m.param_names <= KV_SCALE_PARAMS for m in self.modules.values()) or any(
            r.group is group for _, r in self.roles.kv_roles()
        )

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


# the text config's sizes a plan of the whole model derives its per-layer and per-head arrays from
REQUIRED_TEXT_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")


def check_config_sizes(ckpt: Checkpoint) -> None:
    """For the commands that judge a whole checkpoint (verify, plan hybrid): config.json has the model's
    sizes, and its layer count is one the shards have. A named error naming config.json, before anything
    is allocated per layer (a layer count of 10^8 ran verify out of memory one missing module at a time).
    Not part of build_map: a subset fetched for assemble (one layer's experts) has fewer layers than its
    config by design."""
    cfg = ckpt.config or {}
    nested = isinstance(cfg.get("text_config"), dict)
    text = ckpt.text_config
    where = "text_config." if nested else ""
    missing = [k for k in REQUIRED_TEXT_SIZES if k not in text]
    if missing:
        raise ConfigError(
            f"config.json has no {where}{missing[0]}" + ("" if nested else " (and no text_config)"),
            path=ckpt.root / CONFIG_NAME,
            expected=f"{where or 'text_config.'}{', '.join(missing)}",
            hint="restore config.json from the source repository (Qwen3.5 keeps the model's sizes under text_config)",
        )
    explicit = text.get("layer_types") or []
    count, key = max((text["num_hidden_layers"], "num_hidden_layers"), (len(explicit), "layer_types"))
    prefix = f"{TEXT_PREFIX[detect_naming(ckpt.tensors)]}layers."
    if any(name.startswith(f"{prefix}{count - 1}.") for name in ckpt.tensors):
        return
    present = {
        int(head)
        for head in (name[len(prefix) :].partition(".")[0] for name in ckpt.tensors if name.startswith(prefix))
        if head.isdigit()
    }
    got = f"decoder layers 0-{max(present)} in the shards" if present else "no decoder layer in the shards"
    raise ConfigError(
        f"config.json: {where}{key} says {count} decoder layers, the shards have no layer {count - 1}",
        path=ckpt.root / CONFIG_NAME,
        expected=f"{where}{key} of at most {max(present, default=-1) + 1}",
        got=got,
        hint=f"fix {where}{key} in config.json (or restore the file from the source "
        "repository), or add the missing shards",
    )


def build_map(ckpt: Checkpoint, *, read_values: bool = True) -> ModelMap:
    """The checkpoint's modules and roles. Everything comes from headers except the KV scale values
    (`kv.values`, `kv.calibrated`, `kv.invalid`); `read_values=False` leaves those empty, for shards whose
    data is still being written (then call `read_kv_values` once it is)."""
    memo = _REUSED.get()
    if memo is not None:  # inside reuse_opened(): one map per opened checkpoint
        key = ("model_map", id(ckpt), read_values)
        if key not in memo:
            memo[key] = (ckpt, _built_map(ckpt, read_values))  # the checkpoint kept alive: its id stays unique
        return memo[key][1]
    return _built_map(ckpt, read_values)


def _built_map(ckpt: Checkpoint, read_values: bool) -> ModelMap:
    with no_cyclic_gc():  # hundreds of thousands of acyclic objects
        return _build_map(ckpt, read_values)


def _build_map(ckpt: Checkpoint, read_values: bool = True) -> ModelMap:
    tensors = ckpt.tensors
    naming = detect_naming(tensors)
    kv_roles: dict[str, TensorRole] = {}
    modules: dict[str, Module] = {}
    for name, _, dtype, shape in tensor_rows(tensors):
        module_name, _, param = name.rpartition(".")
        is_kv = param in KV_SCALE_PARAMS
        mod = modules.get(module_name)
        if mod is None:
            # Classify once per module (an NVFP4 expert Linear has 4 tensors). A module's role comes
            # from the module name; KV scales (k_proj.k_scale) are roles of their own tensors only.
            r = classify(module_name + ".weight" if is_kv else name, naming)
            mod = modules[module_name] = Module(module_name, r.group, r.inner, r.layer, r.expert, (), None, tensors)
        if is_kv:
            kv_roles[name] = classify(name, naming)
        mod.signature = extend_signature(mod.signature, param, dtype, len(shape))
    for mod in modules.values():
        mod.format = signature_format(mod.signature)
    roles = RoleMap(tensors, modules, kv_roles)

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
        ckpt,
        naming,
        roles,
        modules,
        types,
        full,
        overall,
        layer_layout,
        _layout(mtp_kinds),
        _kv_scales(ckpt, roles, full, read_values),
    )


def _kv_scales(ckpt: Checkpoint, roles: RoleMap, full: list[int], read_values: bool = True) -> KvScales:
    found: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    namings: Counter[str] = Counter()
    for name, role in roles._kv.items():
        if role.group is not Group.KV_SCALE or role.layer is None:
            continue
        found[role.layer][role.param] = ckpt.tensors[name]
        namings["modelopt" if role.module.endswith(("k_proj", "v_proj")) else "compressed-tensors"] += 1
    layers = sorted(layer for layer, p in found.items() if "k_scale" in p and "v_scale" in p)
    values: dict[int, tuple[float, float]] = {}
    invalid: list[str] = []
    # per attention head (compressed-tensors `strategy: attn_head`, vllm PR 30141): one F32 per KV head
    per_head = any(found[layer][p].numel > 1 for layer in layers for p in ("k_scale", "v_scale"))
    for layer in layers if read_values else []:
        pair = []
        for p in ("k_scale", "v_scale"):
            info = found[layer][p]
            try:
                vs = read_floats(info) if info.numel >= 1 else [float("nan")]
            except ValueError:
                vs = [float("nan")]
            if not all(math.isfinite(v) and v > 0 for v in vs):
                invalid.append(info.name)
            pair.append(max(vs))
        values[layer] = (pair[0], pair[1])
    calibrated = None
    if values:
        flat = [v for kv in values.values() for v in kv]
        calibrated = not all(v == 1.0 for v in flat) and not invalid
    naming = namings.most_common(1)[0][0] if namings else None
    return KvScales(layers, naming, calibrated, values, invalid, per_head)
