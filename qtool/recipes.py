"""Quantization recipes: which module groups of a Qwen3.5-MoE checkpoint get which scheme.

A recipe is a YAML file in `recipes/` (or any path), validated here at the boundary into a frozen
`Recipe`. Schema (version 1):

    schema_version: 1
    name: qwen35-nvfp4-experts
    description: free text
    groups:                      # group -> scheme; groups not listed stay bf16
      routed_experts: nvfp4      # bf16 | nvfp4 | w4a16
      attention: fp8             # bf16 | fp8 (also shared_expert, linear_attn): W8A8 per tensor, static input
    layer_overrides:             # optional: decoder layer index -> {group: scheme}
      0: {routed_experts: bf16}
    kv_cache: fp8                # fp8 | none   (FP8 KV-cache scales calibrated on the full-attention layers)
    nvfp4:                       # only with an nvfp4 group
      weight_scale: max          # max (RTN from amax) | mse (7 shrink factors per block)
                                 # | mse_sweep (126 E4M3 scales per block) | four_over_six (max -> 6 or 4 per block)
                                 # | local_hessian (126 E4M3 scales per block, lowest error on the
                                 #   expert's calibration inputs: dwᵀ H dw)
      input_scale: layer_max     # layer_max (ModelOpt: one amax shared by all experts) | per_expert
    int4:                        # only with a w4a16 group
      group_size: 128
      awq: true                  # activation-aware scale search (see qtool.ops.quantize.awq_search)
      awq_grid: 20
    gptq:                        # optional: the routed experts' codes by GPTQ (qtool.ops.quantize.gptq),
                                 # nvfp4 or w4a16
      enabled: true              # on the grid the rest of the recipe chooses (nvfp4.weight_scale,
                                 # int4.group_size / awq)
      damp: 0.01                 # added to H's diagonal, times its mean
      block_size: 128            # columns per lazy batch update
      act_order: false           # code columns in descending order of H's diagonal (the stored layout is unchanged)
      scales: fixed              # nvfp4: fixed (every block scale chosen from the weights before GPTQ starts)
                                 # | updated (each block's chosen when GPTQ reaches it, from the weights its
                                 #   error compensation updated, by nvfp4.weight_scale: max, mse_sweep or
                                 #   local_hessian; needs act_order false and block_size a multiple of 16)
    defaults: {backend: rtn, format: modelopt}
    calibration:                 # the data the recipe is meant to calibrate on (plans warn when a run uses less)
      {dataset: "hf:HuggingFaceH4/ultrachat_200k:train_sft", samples: 128, seq_len: 2048}
      experts: natural           # optional: natural (the model's own routing) | all (each routed expert's
                                 # statistics from every calibration token; the layer's output stays routed)
      min_expert_tokens: 1       # optional: an expert that saw fewer tokens gets the fallback rule
                                 # (qtool.ops.quantize.coverage); 1: only an expert that saw none

The routed experts take a 4-bit scheme (nvfp4 or w4a16); attention, the shared expert and the GDN
projections may take fp8 (W8A8, one weight scale and one calibrated static input scale per tensor) next to
nvfp4 experts: a mixed recipe (nvidia's NVFP4-V2 form), written as one ModelOpt MIXED_PRECISION checkpoint
or a compressed-tensors one with an NVFP4 and an FP8 config group. The MTP head, the vision tower, the
router, the shared expert gate, lm_head and the GDN `in_proj_a/b` always stay BF16 (docs/formats.md).
What the engines cannot load is rejected with a RecipeError that says how to fix the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from qtool.errors import QtoolError
from qtool.io.yamlio import load_recipe_yaml

SCHEMA_VERSION = 1


class RecipeError(QtoolError):
    """A recipe file that is missing, malformed or asks for something qtool cannot do."""

    exit_code = 2


class Scheme(str, Enum):
    BF16 = "bf16"
    NVFP4 = "nvfp4"  # E2M1 weights, FP8 block scales (16), FP32 global scale; static FP4 activations
    W4A16 = "w4a16"  # INT4 weights, symmetric, one BF16 scale per group; BF16 activations
    FP8 = "fp8"  # E4M3 weights, one FP32 scale per tensor; static per-tensor FP8 activations (calibrated amax)


class WeightScale(str, Enum):
    MAX = "max"  # round to nearest from each block's maximum (ModelOpt's default)
    MSE = "mse"  # each block's scale: the maximum shrunk by 1.0 .. 0.7, lowest squared error
    MSE_SWEEP = "mse_sweep"  # each block's scale: every E4M3 value tried, lowest squared error
    FOUR_OVER_SIX = "four_over_six"  # each block's max mapped to 6 or to 4, the lower squared error kept
    # every E4M3 value tried, lowest output error dwᵀ H dw under the expert's calibration inputs' second
    # moments (qtool.ops.quantize.local_hessian); an expert without tokens: mse_sweep's scales
    LOCAL_HESSIAN = "local_hessian"


class InputScale(str, Enum):
    LAYER_MAX = "layer_max"
    PER_EXPERT = "per_expert"


class ExpertTokens(str, Enum):
    """Which calibration tokens each routed expert's statistics come from."""

    NATURAL = "natural"  # the tokens the model's router sends it
    ALL = "all"  # every token (llm-compressor's moe_calibrate_all_experts); the layer's output stays routed


class KvCache(str, Enum):
    FP8 = "fp8"
    NONE = "none"


class Backend(str, Enum):
    RTN = "rtn"
    MODELOPT = "modelopt"
    LLMCOMPRESSOR = "llmcompressor"


class OutFormat(str, Enum):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"
    AWQ = "awq"  # AutoAWQ GEMM qweight/qzeros/scales (W4A16 only)


# Which output formats can carry which quantized scheme.
FORMATS_FOR: dict[Scheme, tuple[OutFormat, ...]] = {
    Scheme.NVFP4: (OutFormat.MODELOPT, OutFormat.COMPRESSED_TENSORS),
    Scheme.W4A16: (OutFormat.COMPRESSED_TENSORS, OutFormat.AWQ),
    Scheme.FP8: (OutFormat.MODELOPT, OutFormat.COMPRESSED_TENSORS),
}

# Groups a recipe may name, and the schemes each may take. FP8 goes to the dense linears vLLM and SGLang
# load as FP8 W8A8 next to NVFP4 experts (vLLM modelopt.py ModelOptMixedPrecisionConfig, vllm PR 35047);
# the router and the shared expert gate are built unquantized by both engines (vllm PR 35156).
GROUP_SCHEMES: dict[str, tuple[Scheme, ...]] = {
    "routed_experts": (Scheme.BF16, Scheme.NVFP4, Scheme.W4A16),
    "shared_expert": (Scheme.BF16, Scheme.FP8),
    "shared_expert_gate": (Scheme.BF16,),
    "attention": (Scheme.BF16, Scheme.FP8),
    "linear_attn": (Scheme.BF16, Scheme.FP8),
    "router": (Scheme.BF16,),
    "lm_head": (Scheme.BF16,),
    "mtp": (Scheme.BF16,),
    "vision": (Scheme.BF16,),
}

_TOP_KEYS = {
    "schema_version",
    "name",
    "description",
    "groups",
    "layer_overrides",
    "kv_cache",
    "nvfp4",
    "int4",
    "gptq",
    "defaults",
    "calibration",
}


@dataclass(frozen=True)
class NVFP4Options:
    weight_scale: WeightScale = WeightScale.MAX
    input_scale: InputScale = InputScale.LAYER_MAX


@dataclass(frozen=True)
class Int4Options:
    group_size: int = 128
    awq: bool = True
    awq_grid: int = 20


@dataclass(frozen=True)
class ExpertCoverage:
    """The recipe's `calibration.experts` and `calibration.min_expert_tokens`. min_tokens 1 (the default) is
    the rule qtool always had: only an expert that saw no token falls back (it has nothing of its own), so
    a recipe that does not name these codes the same bytes as before they existed."""

    experts: ExpertTokens = ExpertTokens.NATURAL
    min_tokens: int = 1

    def to_json(self) -> dict:
        return {"experts": self.experts.value, "min_expert_tokens": self.min_tokens}


class GptqScales(str, Enum):
    FIXED = "fixed"  # the block scales chosen from the weights before GPTQ starts
    UPDATED = "updated"  # each block's chosen when GPTQ reaches it, from the error-updated weights


# the nvfp4.weight_scale criteria GPTQ can apply to the updated weights (gptq_layer.UpdatedScales)
UPDATED_SCALE_CRITERIA = (WeightScale.MAX, WeightScale.MSE_SWEEP, WeightScale.LOCAL_HESSIAN)


@dataclass(frozen=True)
class GptqOptions:
    enabled: bool = False
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    scales: GptqScales = GptqScales.FIXED

    def to_json(self) -> dict:
        out = {"enabled": self.enabled, "damp": self.damp, "block_size": self.block_size, "act_order": self.act_order}
        if self.scales is not GptqScales.FIXED:  # a recipe that does not name it reports as before
            out["scales"] = self.scales.value
        return out


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    groups: dict[str, Scheme]
    layer_overrides: dict[int, dict[str, Scheme]] = field(default_factory=dict)
    kv_cache: KvCache = KvCache.FP8
    nvfp4: NVFP4Options = NVFP4Options()
    int4: Int4Options = Int4Options()
    gptq: GptqOptions = GptqOptions()
    backend: Backend = Backend.RTN
    format: OutFormat = OutFormat.MODELOPT
    path: str | None = None
    calibration: dict | None = None  # {dataset, samples, seq_len}: the data the recipe is meant for
    expert_coverage: ExpertCoverage = ExpertCoverage()  # calibration.experts / calibration.min_expert_tokens

    def scheme_for(self, group: str, layer: int | None) -> Scheme:
        if layer is not None and group in self.layer_overrides.get(layer, {}):
            return self.layer_overrides[layer][group]
        return self.groups.get(group, Scheme.BF16)

    @property
    def schemes(self) -> frozenset[Scheme]:
        """Every non-BF16 scheme the recipe uses, layer overrides included."""
        return _used_schemes(self.groups, self.layer_overrides)

    @property
    def quantized_scheme(self) -> Scheme:
        """The routed experts' scheme (a recipe's 4-bit scheme); FP8 for a recipe that quantizes only the
        dense linears; BF16 for none."""
        return _main_scheme(self.schemes)

    @property
    def is_mixed(self) -> bool:
        """Two quantized schemes (NVFP4 experts, FP8 dense linears): one MIXED_PRECISION checkpoint."""
        return len(self.schemes) > 1

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "schema_version": SCHEMA_VERSION,
            "description": self.description,
            "groups": {g: s.value for g, s in sorted(self.groups.items())},
            "layer_overrides": {
                str(k): {g: s.value for g, s in v.items()} for k, v in sorted(self.layer_overrides.items())
            },
            "kv_cache": self.kv_cache.value,
            "nvfp4": {"weight_scale": self.nvfp4.weight_scale.value, "input_scale": self.nvfp4.input_scale.value},
            "int4": {"group_size": self.int4.group_size, "awq": self.int4.awq, "awq_grid": self.int4.awq_grid},
            "gptq": self.gptq.to_json(),
            "defaults": {"backend": self.backend.value, "format": self.format.value},
            "calibration": self.calibration,
            "expert_coverage": self.expert_coverage.to_json(),
            "path": self.path,
        }


def recipes_dir() -> Path:
    """The shipped quantization recipes (package data: `qtool/data/recipes/`; `recipes/` in the repo links
    there); build recipes are in its `build/` folder."""
    return Path(__file__).resolve().parent / "data" / "recipes"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is no number


def _enum(cls, value, where: str, path):
    try:
        return cls(value)
    except (ValueError, TypeError):
        raise RecipeError(f"unknown value for {where}", path=path, expected=[m.value for m in cls], got=value) from None


def _mapping(obj, where: str, path) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise RecipeError(f"{where} must be a mapping", path=path, got=type(obj).__name__)
    return obj


def _groups(obj, where: str, path) -> dict[str, Scheme]:
    out = {}
    for g, s in _mapping(obj, where, path).items():
        if g not in GROUP_SCHEMES:
            raise RecipeError(f"unknown group in {where}", path=path, expected=sorted(GROUP_SCHEMES), got=g)
        scheme = _enum(Scheme, s, f"{where}.{g}", path)
        if scheme not in GROUP_SCHEMES[g]:
            raise RecipeError(
                f"{where}.{g}: scheme {scheme.value} is not supported for this group",
                path=path,
                expected=[x.value for x in GROUP_SCHEMES[g]],
                got=scheme.value,
                hint="routed experts take nvfp4 or w4a16; attention, shared_expert and linear_attn take fp8; "
                "the router, shared_expert_gate, lm_head, MTP and vision stay BF16 and excluded",
            )
        out[g] = scheme
    return out


def parse_recipe(data, *, path: str | None = None) -> Recipe:
    """Validate a recipe's parsed YAML into a Recipe (raises RecipeError with the offending key)."""
    if not isinstance(data, dict):
        raise RecipeError("a recipe must be a YAML mapping", path=path, got=type(data).__name__)
    unknown = sorted(map(str, set(data) - _TOP_KEYS))
    if unknown:
        raise RecipeError("unknown recipe keys", path=path, expected=sorted(_TOP_KEYS), got=unknown)
    if not _is_int(data.get("schema_version")) or data["schema_version"] != SCHEMA_VERSION:
        raise RecipeError(
            "unsupported recipe schema_version", path=path, expected=SCHEMA_VERSION, got=data.get("schema_version")
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise RecipeError("recipe needs a `name`", path=path)
    groups = _groups(data.get("groups"), "groups", path)
    overrides: dict[int, dict[str, Scheme]] = {}
    for k, v in _mapping(data.get("layer_overrides"), "layer_overrides", path).items():
        if not _is_int(k) or k < 0:
            raise RecipeError("layer_overrides keys are decoder layer indices (integers >= 0)", path=path, got=repr(k))
        idx = k
        overrides[idx] = _groups(v, f"layer_overrides.{idx}", path)
    used = _used_schemes(groups, overrides)
    _check_mix(used, path)
    nv = _mapping(data.get("nvfp4"), "nvfp4", path)
    bad = sorted(map(str, set(nv) - {"weight_scale", "input_scale"}))
    if bad:
        raise RecipeError("unknown nvfp4 options", path=path, got=bad)
    nvfp4 = NVFP4Options(
        _enum(WeightScale, nv.get("weight_scale", "max"), "nvfp4.weight_scale", path),
        _enum(InputScale, nv.get("input_scale", "layer_max"), "nvfp4.input_scale", path),
    )
    i4 = _mapping(data.get("int4"), "int4", path)
    bad = sorted(map(str, set(i4) - {"group_size", "awq", "awq_grid"}))
    if bad:
        raise RecipeError("unknown int4 options", path=path, got=bad)
    gs = i4.get("group_size", 128)
    if not _is_int(gs) or gs < 8 or gs % 8:
        raise RecipeError("int4.group_size must be a positive multiple of 8", path=path, got=gs)
    grid = i4.get("awq_grid", 20)
    if not _is_int(grid) or grid < 1:
        raise RecipeError("int4.awq_grid must be a positive integer", path=path, got=grid)
    awq = i4.get("awq", True)
    if not isinstance(awq, bool):
        raise RecipeError("int4.awq must be true or false", path=path, got=repr(awq))
    int4 = Int4Options(gs, awq, grid)
    gptq = _gptq(data.get("gptq"), used, path)
    _check_gptq_scales(gptq, used, nvfp4, path)
    d = _mapping(data.get("defaults"), "defaults", path)
    backend = _enum(Backend, d.get("backend", "rtn"), "defaults.backend", path)
    scheme = _main_scheme(used)
    fmt_default = FORMATS_FOR.get(scheme, (OutFormat.MODELOPT,))[0].value
    fmt = _enum(OutFormat, d.get("format", fmt_default), "defaults.format", path)
    for held in sorted(used, key=lambda s: s is not scheme):  # the main scheme's refusal first
        if fmt not in FORMATS_FOR[held]:
            raise RecipeError(
                f"defaults.format {fmt.value} cannot hold {held.value}",
                path=path,
                expected=[f.value for f in FORMATS_FOR[held]],
                got=fmt.value,
            )
    return Recipe(
        name=name,
        description=str(data.get("description") or ""),
        groups=groups,
        layer_overrides=overrides,
        kv_cache=_enum(KvCache, data.get("kv_cache", "fp8"), "kv_cache", path),
        nvfp4=nvfp4,
        int4=int4,
        gptq=gptq,
        backend=backend,
        format=fmt,
        path=path,
        calibration=_calibration(data.get("calibration"), path),
        expert_coverage=_expert_coverage(data.get("calibration"), path),
    )


def _check_gptq_scales(gptq: GptqOptions, used: frozenset[Scheme], nvfp4: NVFP4Options, path) -> None:
    """Refuse the pairs of gptq.scales and the rest of the recipe that GPTQ cannot code."""
    if not gptq.enabled or Scheme.NVFP4 not in used:
        if gptq.scales is GptqScales.UPDATED:
            raise RecipeError(
                "gptq.scales updated chooses NVFP4 block scales: it needs gptq enabled and routed_experts nvfp4",
                path=path,
                hint="set gptq.enabled true and groups.routed_experts nvfp4, or drop gptq.scales",
            )
        return
    criterion = nvfp4.weight_scale
    if gptq.scales is GptqScales.FIXED and criterion is WeightScale.LOCAL_HESSIAN:
        # local_hessian's scales come from the Hessians GPTQ codes with: chosen as GPTQ reaches each block
        raise RecipeError(
            "gptq with nvfp4.weight_scale local_hessian needs gptq.scales updated",
            path=path,
            hint="add scales: updated to the gptq mapping, or use weight_scale mse_sweep",
        )
    if gptq.scales is GptqScales.UPDATED:
        if criterion not in UPDATED_SCALE_CRITERIA:
            raise RecipeError(
                f"gptq.scales updated cannot choose nvfp4.weight_scale {criterion.value} block scales",
                path=path,
                expected=[c.value for c in UPDATED_SCALE_CRITERIA],
                got=criterion.value,
            )
        if gptq.act_order or gptq.block_size % 16:
            raise RecipeError(
                "gptq.scales updated needs act_order false and block_size a multiple of 16 (each 16-column block "
                "whole inside one update batch, in the columns' own order)",
                path=path,
                got={"act_order": gptq.act_order, "block_size": gptq.block_size},
            )


def _gptq(obj, used: frozenset[Scheme], path) -> GptqOptions:
    """The `gptq:` mapping, strictly: booleans, damp in (0, 1], block_size >= 1; only with 4-bit experts."""
    g = _mapping(obj, "gptq", path)
    known = ["act_order", "block_size", "damp", "enabled", "scales"]
    bad = sorted(map(str, set(g) - set(known)))
    if bad:
        raise RecipeError("unknown gptq options", path=path, expected=known, got=bad)
    for key in ("enabled", "act_order"):
        if not isinstance(g.get(key, False), bool):
            raise RecipeError(f"gptq.{key} must be true or false", path=path, got=repr(g[key]))
    damp = g.get("damp", 0.01)
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp <= 1:
        raise RecipeError("gptq.damp must be a number in (0, 1]", path=path, got=repr(damp))
    block = g.get("block_size", 128)
    if not _is_int(block) or block < 1:
        raise RecipeError("gptq.block_size must be a positive integer", path=path, got=repr(block))
    scales = _enum(GptqScales, g.get("scales", "fixed"), "gptq.scales", path)
    options = GptqOptions(g.get("enabled", False), float(damp), block, g.get("act_order", False), scales)
    if options.enabled and not used & {Scheme.NVFP4, Scheme.W4A16}:
        raise RecipeError(
            "gptq codes the routed experts: it needs routed_experts nvfp4 or w4a16",
            path=path,
            got=sorted(s.value for s in used),
            hint="set groups.routed_experts to nvfp4 or w4a16, or drop the gptq mapping",
        )
    return options


def _used_schemes(groups: dict[str, Scheme], overrides: dict[int, dict[str, Scheme]]) -> frozenset[Scheme]:
    used = {s for s in groups.values() if s is not Scheme.BF16}
    used |= {s for o in overrides.values() for s in o.values() if s is not Scheme.BF16}
    return frozenset(used)


def _main_scheme(used: frozenset[Scheme]) -> Scheme:
    for scheme in (Scheme.NVFP4, Scheme.W4A16, Scheme.FP8):
        if scheme in used:
            return scheme
    return Scheme.BF16


def _check_mix(used: frozenset[Scheme], path) -> None:
    """The one mix the engines load: NVFP4 routed experts with FP8 dense linears (vLLM 0.33
    ModelOptMixedPrecisionConfig accepts FP8 / NVFP4 / W4A16_NVFP4 entries, not INT4; AutoAWQ's format has
    no FP8 at all)."""
    if Scheme.W4A16 in used and Scheme.FP8 in used:
        raise RecipeError(
            "w4a16 routed experts cannot be mixed with fp8 groups",
            path=path,
            got=sorted(s.value for s in used),
            hint="keep the fp8 groups bf16 with w4a16 experts, or make the routed experts nvfp4 "
            "(nvfp4 experts + fp8 attention/shared_expert/linear_attn is the mix vLLM and SGLang load)",
        )


_CALIBRATION_DATA = ("dataset", "samples", "seq_len")
_CALIBRATION_EXPERTS = ("experts", "min_expert_tokens")


def _calibration(obj, path) -> dict | None:
    """The data part of `calibration:` (all three keys, or none of them: a recipe may give only the expert
    options)."""
    if obj is None:
        return None
    c = _mapping(obj, "calibration", path)
    unknown = sorted(map(str, set(c) - set(_CALIBRATION_DATA) - set(_CALIBRATION_EXPERTS)))
    if unknown:
        raise RecipeError(
            "unknown calibration keys", path=path, expected=[*_CALIBRATION_DATA, *_CALIBRATION_EXPERTS], got=unknown
        )
    if not any(k in c for k in _CALIBRATION_DATA):
        return None
    if not isinstance(c.get("dataset"), str) or not all(_is_int(c.get(k)) and c[k] > 0 for k in ("samples", "seq_len")):
        raise RecipeError("calibration needs {dataset: TEXT, samples: N, seq_len: N}", path=path, got=obj)
    return {"dataset": c["dataset"], "samples": c["samples"], "seq_len": c["seq_len"]}


def _expert_coverage(obj, path) -> ExpertCoverage:
    c = _mapping(obj, "calibration", path)
    experts = _enum(ExpertTokens, c.get("experts", "natural"), "calibration.experts", path)
    floor = c.get("min_expert_tokens", 1)
    if not _is_int(floor) or floor < 1:
        raise RecipeError(
            "calibration.min_expert_tokens must be an integer >= 1",
            path=path,
            got=repr(floor),
            hint="1 (the default) falls back only for an expert that saw no token; a larger N also for one "
            "that saw fewer than N",
        )
    return ExpertCoverage(experts, floor)


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name (`qwen35-nvfp4-experts`) or a YAML file path, strictly read (qtool.io.yamlio);
    a RecipeError (a usage error) names the file and the key."""
    p = Path(name_or_path)
    if not p.suffix and len(p.parts) == 1:
        cand = recipes_dir() / f"{name_or_path}.yaml"
        if not cand.is_file():
            raise RecipeError(
                "no such recipe",
                got=str(name_or_path),
                expected=list_recipes(),
                hint="pass a shipped recipe name or the path of a YAML file",
            )
        p = cand
    return parse_recipe(load_recipe_yaml(p, "recipe", RecipeError), path=str(p))
