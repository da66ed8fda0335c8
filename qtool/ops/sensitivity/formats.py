"""The candidate formats of `qtool sensitivity --formats` and `qtool plan hybrid`: what each unit may be
stored as, what it costs in each, and its weights coded in each for the streamed pass to measure.

A unit (qtool.ops.sensitivity.units) maps to one recipe group (qtool.recipes.GROUP_SCHEMES): a layer's
routed experts take bf16 or nvfp4, its shared expert and its token mixer (`attention` on full-attention
layers, `linear_attn` on Gated-DeltaNet ones) bf16 or fp8. The bytes of a unit in a format are the bytes
`qtool quantize` writes for it with that scheme: NVFP4 per weight matrix the packed E2M1 codes (1/2 byte a
weight), one E4M3 scale per 16 weights and two float32 scalars (weight_scale_2, input_scale); FP8 W8A8 per
linear one byte a weight and two float32 scalars (weight_scale, input_scale); the modules the scheme does
not code (norms, conv1d, GDN's in_proj_a/b) stay BF16. The weights are coded with quantize's own codecs
(qtool.ops.quantize.layer.nvfp4_rtn, qtool.formats.fp8.w8a8_per_tensor) and decoded back: the error the pass
measures is that of the weights quantize would write (activations unquantized, as the table's error of a
quantized checkpoint is measured on its dequantized weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from qtool.arch.qwen35 import Group
from qtool.errors import UsageError
from qtool.formats import fp8, nvfp4
from qtool.ops.quantize.layer import nvfp4_rtn  # quantize's NVFP4 of a chunk of experts: the code a recipe runs
from qtool.ops.quantize.schemes import FP8_LINEARS
from qtool.ops.verify.memory_fit import _share
from qtool.recipes import GROUP_SCHEMES, NVFP4Options, Recipe, Scheme, WeightScale

if TYPE_CHECKING:
    import torch

    from qtool.arch.model_map import Module


class Candidate(str, Enum):
    """A format a unit may be planned in (a recipe scheme the planner can write per layer)."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


FLAG = "--formats"
SCALAR_BYTES = 8  # two float32 scalars per coded matrix (NVFP4: weight_scale_2 + input_scale; FP8: the two scales)
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class FormatSet:
    """The candidates of a table (their order as given) and the NVFP4 block-scale method they were measured
    with (the written recipe's `nvfp4.weight_scale`)."""

    candidates: tuple[Candidate, ...]
    weight_scale: WeightScale | None = None  # None: not named (sensitivity measures with max)

    @property
    def names(self) -> list[str]:
        return [c.value for c in self.candidates]

    def to_json(self) -> dict:
        return {"candidates": self.names, "nvfp4": {"weight_scale": self.method.value}}

    @property
    def method(self) -> WeightScale:
        return self.weight_scale or WeightScale.MAX

    @classmethod
    def from_json(cls, d: dict) -> FormatSet:
        return cls(tuple(Candidate(c) for c in d["candidates"]), WeightScale(d["nvfp4"]["weight_scale"]))


def parse_formats(text: str, flag: str = FLAG) -> FormatSet:
    """`bf16,fp8,nvfp4` (or `nvfp4:METHOD`, METHOD a recipe's nvfp4.weight_scale) -> FormatSet; a usage
    error names the flag and the value it does not know."""
    known = [c.value for c in Candidate]
    methods = [m.value for m in WeightScale]
    out: list[Candidate] = []
    method = None
    for item in (x.strip() for x in str(text).split(",")):
        name, _, how = item.partition(":")
        if name not in known:
            raise UsageError(
                f"{flag}: unknown format {item!r}",
                expected=known,
                got=text,
                hint=f"{flag} bf16,fp8,nvfp4 (nvfp4:METHOD picks the block-scale method: {', '.join(methods)})",
            )
        cand = Candidate(name)
        if cand in out:
            raise UsageError(f"{flag}: {name} is listed twice", got=text, hint=f"{flag} bf16,fp8,nvfp4")
        if how:
            if cand is not Candidate.NVFP4 or how not in methods:
                raise UsageError(
                    f"{flag}: {item!r} names no block-scale method",
                    expected=[f"nvfp4:{m}" for m in methods],
                    got=item,
                    hint="only nvfp4 takes a method (the recipe's nvfp4.weight_scale)",
                )
            method = WeightScale(how)
        out.append(cand)
    return FormatSet(tuple(out), method)


def recipe_group(kind: str, modules: list[Module]) -> str:
    """The recipe group a unit is (its token mixer: `attention` or `linear_attn`, by its modules)."""
    if kind != "attention":
        return kind
    return "linear_attn" if any(m.group is Group.LINEAR_ATTN for m in modules) else "attention"


def choices(group: str, formats: FormatSet) -> list[Candidate]:
    """The candidates the group takes (in the given order); BF16 alone when it takes none of them."""
    took = [c for c in formats.candidates if Scheme(c.value) in GROUP_SCHEMES[group]]
    return took or [Candidate.BF16]


def _relative(mod: Module) -> str:
    """`self_attn.q_proj` of `model.language_model.layers.3.self_attn.q_proj`."""
    return mod.name.split(f"layers.{mod.layer}.", 1)[1]


def _nvfp4_bytes(mod: Module) -> int:
    """A routed-experts module coded NVFP4: per-expert `weight`s or the fused 3-D `gate_up_proj` (gate and
    up are two matrices of each expert) / `down_proj`."""
    total = 0
    for param, info in mod.params.items():
        numel = info.numel
        if len(info.shape) < 2:
            total += info.nbytes  # (none in a routed-experts module; kept as stored)
            continue
        matrices = numel // (info.shape[-2] * info.shape[-1]) * (2 if param == "gate_up_proj" else 1)
        total += numel // 2 + numel // NVFP4_BLOCK + SCALAR_BYTES * matrices
    return total


def module_bytes(mod: Module, group: str, fmt: Candidate) -> int:
    """What quantize writes for one module of a unit of `group` given `fmt` (its BF16 bytes where the
    scheme does not code it)."""
    if fmt is Candidate.NVFP4 and group == "routed_experts":
        return _nvfp4_bytes(mod)
    if fmt is Candidate.FP8 and _relative(mod) in FP8_LINEARS.get(group, ()):
        return mod.params["weight"].numel + SCALAR_BYTES
    return mod.nbytes()


def format_costs(
    bf_modules: list[Module], q_modules: list[Module], group: str, fmt: Candidate, tps, nkv: int
) -> tuple[int, dict[int, int]]:
    """(bytes of the unit in `fmt`, {TP: bytes one GPU holds more than with the quantized checkpoint's
    unit}); negative where `fmt` is smaller than what the quantized checkpoint has."""
    nbytes = sum(module_bytes(m, group, fmt) for m in bf_modules)
    extra = {
        tp: round(
            sum(module_bytes(m, group, fmt) * _share(m, tp, nkv) for m in bf_modules)
            - sum(m.nbytes() * _share(m, tp, nkv) for m in q_modules)
        )
        for tp in tps
    }
    return nbytes, extra


# ---- the weights coded and decoded, for the streamed pass ----


def _fp8_weight(w: torch.Tensor) -> torch.Tensor:
    """A linear's weight as quantize's FP8 W8A8 codes it (its own per-tensor scale), decoded."""
    coded = fp8.w8a8_per_tensor(w, weight_amax=w.abs().amax().float(), input_amax=0.0)
    return fp8.dequantize(coded["weight"], coded["weight_scale"], dtype=w.dtype)


def _nvfp4_experts(experts, weight_scale: WeightScale) -> dict[str, torch.Tensor]:
    """A layer's fused experts as quantize's NVFP4 codes them (gate and up sharing a weight_scale_2),
    decoded: {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}."""
    import torch

    gu, down = experts.gate_up_proj.data, experts.down_proj.data
    inter, n = gu.shape[1] // 2, gu.shape[0]
    zero = torch.zeros(n, device=gu.device)  # input scales: not part of the weights
    recipe = Recipe("sensitivity", "", {}, nvfp4=NVFP4Options(weight_scale=weight_scale))
    parts = nvfp4_rtn(gu, down, inter, zero, zero, recipe)

    def decoded(part: str) -> torch.Tensor:
        q = parts[part]
        return nvfp4.dequantize(q.packed, q.block_scale, q.weight_scale_2, dtype=gu.dtype)

    return {
        "gate_up_proj": torch.cat([decoded("gate_proj"), decoded("up_proj")], dim=1),
        "down_proj": decoded("down_proj"),
    }


def coded_weights(layer, group: str, fmt: Candidate, weight_scale: WeightScale) -> dict[str, torch.Tensor]:
    """{parameter name relative to the decoder layer: its weight coded in `fmt` and decoded} for the unit
    of `group` in `layer` (a transformers decoder layer, dense); empty for BF16."""
    if fmt is Candidate.NVFP4 and group == "routed_experts":
        return {f"mlp.experts.{k}": v for k, v in _nvfp4_experts(layer.mlp.experts, weight_scale).items()}
    if fmt is Candidate.FP8:
        present = {name for name, _ in layer.named_modules()}
        return {
            f"{rel}.weight": _fp8_weight(layer.get_submodule(rel).weight.data)
            for rel in FP8_LINEARS[group]
            if rel in present
        }
    return {}
