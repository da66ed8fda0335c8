"""The candidate units of a hybrid: what can be BF16 instead of quantized, and what each costs.

A unit is one piece the planner can choose whole: a decoder layer's routed experts (vLLM and SGLang load a
layer's experts as one fused MoE: a layer's experts are spliced whole), its shared expert, its token mixer
(full attention or Gated-DeltaNet), the MTP head, lm_head. Costs come from the two checkpoints' headers:
the bytes of the unit in BF16 and as quantized, and the extra bytes per GPU at each TP size with verify's
own sharding rule (qtool.ops.verify.memory_fit: the share of each module one GPU holds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qtool.arch.layer_grid import COLUMNS
from qtool.arch.model_map import QUANTIZED_FORMATS, Format, ModelMap
from qtool.arch.qwen35 import Group
from qtool.errors import PlanError
from qtool.ops.sensitivity.formats import Candidate, FormatSet, choices, format_costs, recipe_group
from qtool.ops.verify.memory_fit import _share

TP_SIZES = (1, 2, 4, 8)
# unit kind -> the groups of modules it holds (outside the MTP head): the report grid's columns of the same
# names, so that the report places a unit in its own cell
KIND_GROUPS: dict[str, tuple[Group, ...]] = {k: COLUMNS[k] for k in ("routed_experts", "shared_expert", "attention")}
# what `assemble hybrid` can splice from BF16 into an NVFP4 checkpoint (the planner's choices)
SPLICEABLE = frozenset({"routed_experts", "shared_expert"})
NVFP4_FORMATS = frozenset({Format.NVFP4, Format.NVFP4_CT})


@dataclass
class Unit:
    id: str  # e.g. "layer.3.routed_experts", "mtp", "lm_head"
    kind: str
    layer: int | None
    quantized_format: str  # the quantized side's format of the unit ("bf16" when it is BF16 there too)
    bf16_bytes: int
    quantized_bytes: int
    extra_bytes_per_gpu: dict[int, int]  # TP -> bytes one GPU holds more with the unit in BF16
    spliceable: bool  # assemble hybrid can make it BF16
    measured: bool = False  # its error was measured (filled by the streamed pass)
    error: float | None = None  # ||unit out (quantized) - unit out (BF16)||^2 / ||unit out (BF16)||^2
    effect: float | None = None  # ||its change to the residual stream||^2 / ||the layer's output||^2
    tokens: int = 0
    note: str = ""
    # with --formats (schema 2): the recipe group it is, and per candidate format {"bytes",
    # "extra_bytes_per_gpu" (vs the quantized checkpoint's unit), "error", "effect"}; absent from a schema-1 row
    group: str | None = None
    formats: dict[str, dict] | None = None

    @property
    def quantized(self) -> bool:
        return self.quantized_format != Format.BF16.value

    def to_json(self) -> dict:
        d = asdict(self)
        d["extra_bytes_per_gpu"] = {str(k): v for k, v in self.extra_bytes_per_gpu.items()}
        d["quantized"] = self.quantized
        if self.formats is not None:
            for row in d["formats"].values():
                row["extra_bytes_per_gpu"] = {str(k): v for k, v in row["extra_bytes_per_gpu"].items()}
        for key in ("group", "formats"):
            if d[key] is None:
                del d[key]  # a table without --formats is the schema-1 table, byte for byte
        return d

    @classmethod
    def from_json(cls, d: dict) -> Unit:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["extra_bytes_per_gpu"] = {int(k): int(v) for k, v in d["extra_bytes_per_gpu"].items()}
        if d.get("formats") is not None:
            fields["formats"] = {
                f: {**row, "extra_bytes_per_gpu": {int(k): int(v) for k, v in row["extra_bytes_per_gpu"].items()}}
                for f, row in d["formats"].items()
            }
        return cls(**fields)


@dataclass
class UnitTable:
    units: list[Unit] = field(default_factory=list)

    def by_id(self) -> dict[str, Unit]:
        return {u.id: u for u in self.units}


def unit_modules(mm: ModelMap) -> dict[str, list]:
    """unit id -> the map's modules in it."""
    out: dict[str, list] = {}
    for mod in mm.modules.values():
        if mod.group is Group.MTP:
            out.setdefault("mtp", []).append(mod)
        elif mod.group is Group.LM_HEAD:
            out.setdefault("lm_head", []).append(mod)
        elif mod.layer is not None:
            for kind, groups in KIND_GROUPS.items():
                if mod.group in groups:
                    out.setdefault(f"layer.{mod.layer}.{kind}", []).append(mod)
    return out


def _per_gpu(mods, tp: int, nkv: int) -> float:
    return sum(m.nbytes() * _share(m, tp, nkv) for m in mods)


def _format_of(mods) -> str:
    fmts = {m.format for m in mods if m.format is not None}
    quant = sorted(f.value for f in fmts if f in QUANTIZED_FORMATS)
    return quant[0] if quant else Format.BF16.value


def check_pair(bf: ModelMap, q: ModelMap) -> None:
    """The two checkpoints are one model in two formats: same layers, widths and experts."""
    keys = (
        "hidden_size",
        "num_experts",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    a, b = bf.ckpt.text_config, q.ckpt.text_config
    if bf.layer_types != q.layer_types:
        raise PlanError(
            "the two checkpoints are not one model: their decoder layers differ",
            path=q.ckpt.root,
            expected=f"{len(bf.layer_types)} layers {bf.layer_types[:6]}...",
            got=f"{len(q.layer_types)} layers {q.layer_types[:6]}...",
            hint="give the BF16 original and a quantized export of that same model",
        )
    for k in keys:
        if a.get(k) != b.get(k):
            raise PlanError(
                f"the two checkpoints are not one model: {k} differs",
                path=q.ckpt.root / "config.json",
                expected=f"{k} {a.get(k)} (as the BF16 checkpoint)",
                got=f"{k} {b.get(k)}",
                hint="give the BF16 original and a quantized export of that same model",
            )
    if not any(m.format in QUANTIZED_FORMATS for m in q.modules.values()):
        raise PlanError(
            "the second checkpoint has no quantized module",
            path=q.ckpt.root,
            hint="give the quantized checkpoint second: qtool sensitivity BF16 QUANTIZED -o OUT",
        )
    if any(m.format in QUANTIZED_FORMATS for m in bf.modules.values() if m.group is not Group.VISION):
        raise PlanError(
            "the first checkpoint is not BF16 (it has quantized modules)",
            path=bf.ckpt.root,
            hint="give the BF16 original first: qtool sensitivity BF16 QUANTIZED -o OUT",
        )


def list_units(bf: ModelMap, q: ModelMap, formats: FormatSet | None = None) -> list[Unit]:
    """Every unit of the model, in model order, with its bytes and its per-GPU cost in BF16; with `formats`,
    each layer unit's bytes and per-GPU cost in each candidate format it takes (measured by the pass)."""
    bf_units, q_units = unit_modules(bf), unit_modules(q)
    nkv = int(q.ckpt.text_config.get("num_key_value_heads") or 0)
    nvfp4 = any(m.format in NVFP4_FORMATS for m in q.modules.values())

    def order(uid: str):
        parts = uid.split(".")
        kinds = list(KIND_GROUPS)
        return (0, int(parts[1]), kinds.index(parts[2])) if parts[0] == "layer" else (1, uid, 0)

    units = []
    for uid in sorted(set(bf_units) | set(q_units), key=order):
        b, qm = bf_units.get(uid, []), q_units.get(uid, [])
        kind = uid.split(".")[-1] if uid.startswith("layer.") else uid
        layer = int(uid.split(".")[1]) if uid.startswith("layer.") else None
        fmt = _format_of(qm) if qm else Format.BF16.value
        extra = {tp: round(_per_gpu(b, tp, nkv) - _per_gpu(qm, tp, nkv)) for tp in TP_SIZES}
        u = Unit(
            uid,
            kind,
            layer,
            fmt,
            sum(m.nbytes() for m in b),
            sum(m.nbytes() for m in qm),
            extra,
            spliceable=nvfp4 and kind in SPLICEABLE and fmt != Format.BF16.value,
        )
        if not qm or not b:
            u.note = f"missing from the {'quantized' if not qm else 'BF16'} checkpoint"
        elif not u.quantized:
            u.note = "BF16 in both checkpoints"
        if formats is not None and b and qm and layer is not None:
            _add_formats(u, b, qm, formats, nkv)
        units.append(u)
    return units


def _add_formats(u: Unit, bf_modules: list, q_modules: list, formats: FormatSet, nkv: int) -> None:
    """The unit's row of each candidate format it takes (error and effect: 0 in BF16, else measured)."""
    u.group = recipe_group(u.kind, bf_modules)
    u.formats = {}
    for fmt in choices(u.group, formats):
        nbytes, extra = format_costs(bf_modules, q_modules, u.group, fmt, TP_SIZES, nkv)
        zero = 0.0 if fmt is Candidate.BF16 else None
        u.formats[fmt.value] = {"bytes": nbytes, "extra_bytes_per_gpu": extra, "error": zero, "effect": zero}
