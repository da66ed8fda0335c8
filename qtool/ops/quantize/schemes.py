"""Which scheme codes each dense linear of a decoder layer, and the FP8 W8A8 coding of those a recipe gives fp8.

The routed experts are coded by qtool.ops.quantize.layer (NVFP4 / W4A16, per chunk of experts); this module
covers the dense linears a mixed recipe quantizes next to them (nvidia's NVFP4-V2 form): attention, the shared
expert and the GDN projections in FP8, one weight scale and one static input scale per tensor. The input
scales come from the calibration forward (a pre-hook per FP8 linear records its input's amax); linears that
read the same input share one input scale, as ModelOpt's export makes them (modelopt/torch/export/
unified_export_hf.py `requantize_resmooth_fused_llm_layers`: the larger amax), while each keeps its own weight
scale (checked against ModelOpt 0.47's export of the same mixed config on the tiny model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.formats import fp8
from qtool.recipes import OutFormat, Recipe, Scheme

if TYPE_CHECKING:
    import torch

# recipe group -> the linears (relative to the decoder layer) it quantizes with FP8. GDN's in_proj_a/b stay
# BF16: ModelOpt's FP8 config disables them (modelopt/torch/quantization/config.py FP8_DEFAULT_CFG), and
# nvidia's NVFP4-V2 keeps them BF16.
FP8_LINEARS: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "shared_expert": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
    "linear_attn": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"),
}

# linears that read one input tensor: one input scale for all of them
SHARED_INPUT: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
)

_STATS_ATTR = "qtool_linear_amax"  # the layer's {linear: input amax} while its forward runs
_HOOKS_ATTR = "qtool_linear_hooks"


def fp8_linears(recipe: Recipe, layer: int, present: set[str]) -> list[str]:
    """The linears of decoder layer `layer` (names relative to it) the recipe codes FP8, of those `present`."""
    return [
        rel
        for group, rels in FP8_LINEARS.items()
        if recipe.scheme_for(group, layer) is Scheme.FP8
        for rel in rels
        if rel in present
    ]


def scalar_shape(fmt: OutFormat) -> tuple[int, ...]:
    """ModelOpt writes 0-d scales; compressed-tensors strategy-tensor scales are [1]."""
    return () if fmt is OutFormat.MODELOPT else (1,)


def fp8_params(fmt: OutFormat, out: int, n_in: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(param, dtype, shape) of one FP8 linear in the output, in name order."""
    s = scalar_shape(fmt)
    shapes = {"input_scale": ("F32", s), "weight": ("F8_E4M3", (out, n_in)), "weight_scale": ("F32", s)}
    return tuple((name, *shapes[name]) for name in fp8.W8A8_PARAMS)


def install_linear_amax(layer: torch.nn.Module, linears: list[str]) -> None:
    """Record the input amax of each of `linears` (relative names) over the layer's calibration forward."""
    import torch

    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for rel in linears:

        def record(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], rel: str = rel) -> None:
            x = args[0].detach()
            m = x.abs().amax().float().cpu()
            amax[rel] = torch.maximum(amax[rel], m) if rel in amax else m

        hooks.append(layer.get_submodule(rel).register_forward_pre_hook(record))
    setattr(layer, _STATS_ATTR, amax)
    setattr(layer, _HOOKS_ATTR, hooks)


def remove_linear_amax(layer: torch.nn.Module) -> None:
    """Drop the hooks; the recorded amaxes stay on the layer for its write."""
    for h in getattr(layer, _HOOKS_ATTR, ()):
        h.remove()
    setattr(layer, _HOOKS_ATTR, [])


def input_amax(layer: torch.nn.Module, rel: str) -> float:
    """The calibrated input amax of linear `rel`: the largest over the linears that read the same input."""
    amax = getattr(layer, _STATS_ATTR, {})
    group = next((g for g in SHARED_INPUT if rel in g), (rel,))
    seen = [float(amax[r]) for r in group if r in amax]
    return max(seen) if seen else 0.0


def code_fp8_linear(layer: torch.nn.Module, rel: str, fmt: OutFormat) -> dict[str, torch.Tensor]:
    """One FP8 linear's output tensors by parameter name, from the dense layer and its calibration."""
    w = layer.get_submodule(rel).weight.data
    return fp8.w8a8_per_tensor(
        w,
        weight_amax=w.abs().amax().float(),
        input_amax=input_amax(layer, rel),
        scalar_shape=scalar_shape(fmt),
    )
