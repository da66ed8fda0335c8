"""Peer backends for `qtool quantize --backend modelopt|llmcompressor`: the peer library's own algorithm,
driven on ONE decoder layer at a time (the dense transformers `Qwen3_5MoeDecoderLayer` that
qtool.stream.layer_stream loads, fed with that layer's cached calibration inputs), then written in exactly
the layout the rtn backend writes (qtool.ops.quantize.layer.NVFP4Experts -> modelopt or
compressed-tensors tensors).

modelopt (nvidia-modelopt 0.47): `mtq.quantize(layer, cfg, forward_loop)` on the layer module alone.
ModelOpt wraps transformers' fused `Qwen3_5MoeExperts` in `_QuantFusedExperts`
(modelopt/torch/quantization/plugins/huggingface.py): one weight quantizer per expert and projection
(`gate_up_proj_weight_quantizers[e]` over the fused gate+up rows, hence gate and up share
weight_scale_2) and ONE input quantizer per projection shared by all experts. cfg = ModelOpt's
`NVFP4_EXPERTS_ONLY_CFG` (routed experts only; "max" calibration) or, for the -mse recipe, the same
entries with static weight block scales and the calibration algorithm of
`NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG` ({"method": "mse", "fp8_scale_sweep": true}: per-block amax
searched over the FP8 scale grid, modelopt/torch/quantization/model_calib.py `mse_calibrate`).
forward_loop runs the layer over the cached inputs without storing its outputs. Scales come from
ModelOpt's export helpers (modelopt/torch/quantization/qtensor/nvfp4_tensor.py
`NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer`, `get_weights_scaling_factor_from_quantizer`,
`get_activation_scaling_factor`, the functions `export_hf_checkpoint` uses); the E2M1 codes are encoded
by qtool's codec with those scales (same division as ModelOpt's `NVFP4QTensor.quantize`). The quantizers
are then disabled, and the hidden states are propagated by the ordinary BF16 forward (as with rtn).

llmcompressor (llm-compressor 0.14 / compressed-tensors 0.19): the observers of its QuantizationModifier
without `oneshot` (which needs the whole model): per expert and projection a weight observer
(`memoryless_minmax`, or `memoryless_mse` for the -mse recipe) with gate_proj and up_proj fused
(`FusionHandler.fuse`: one global scale, what llm-compressor's `update_fused_layer_weight_global_scales`
does), `get_qparams()` -> (FP8 block scales, global scale), and compressed-tensors'
`NVFP4PackedCompressor.compress` for the packed weight; per expert a `static_minmax` input observer fed
with exactly the tokens routed to that expert during the layer's forward (qtool.ops.quantize.calib
hooks), `get_global_scale()` -> input_global_scale. An expert that saw no token has no input statistics:
it gets the layer's largest input amax (documented fallback, never NaN).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from qtool.errors import PlanError
from qtool.formats import nvfp4
from qtool.lazy import lazy_module
from qtool.ops.quantize.layer import NVFP4Experts
from qtool.ops.quantize.plan import QuantizePlan
from qtool.quiet import quiet  # the producer libraries' chatter off, restored on exit
from qtool.recipes import Backend, WeightScale

if TYPE_CHECKING:
    import torch

    from qtool.stream.experts import Recorder
    from qtool.stream.hidden_store import HiddenStore
    from qtool.stream.layer_stream import LayerStreamer
else:
    torch = lazy_module("torch")

PARTS = ("down_proj", "gate_proj", "up_proj")


class LayerCoder(Protocol):
    """What codes a layer's experts in place of qtool's RTN (layer.write_layer_shard): it observes the forward
    through the expert statistics' hooks (calib.ExpertStats), then codes the NVFP4 experts chunk by chunk.
    A peer backend (LayerBackend) or qtool's GPTQ (gptq_layer.GptqLayer)."""

    hooks: list[Recorder]

    def nvfp4_chunk(
        self,
        first_expert: int,
        end_expert: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        in_amax: torch.Tensor,
        mid_amax: torch.Tensor,
    ) -> dict[str, NVFP4Experts]: ...


class LayerBackend(LayerCoder, Protocol):
    """A peer backend's per-layer state (for_layer): it also calibrates the layer before its forward
    (stage.py), with hooks of its own on each forward of the experts module."""

    batch_hooks: list[Callable[[torch.Tensor], None]]

    def calibrate(
        self, layer: torch.nn.Module, streamer: LayerStreamer, store: HiddenStore, seq: int, batch: int
    ) -> None: ...


def _quiet() -> AbstractContextManager[None]:

    return quiet()


# ---------------------------------------------------------------------------------------------- modelopt


def modelopt_config(mse: bool, local_hessian: bool = False) -> dict:
    """ModelOpt's NVFP4 experts-only config; with `mse`, static weight block scales + MSE calibration
    (the FP8 sweep); with `local_hessian`, the same with the algorithm of its
    NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG ({"method": "local_hessian", "fp8_scale_sweep": true})."""
    import modelopt.torch.quantization as mtq

    entries = copy.deepcopy(list(mtq.NVFP4_EXPERTS_ONLY_CFG["quant_cfg"]))
    if not (mse or local_hessian):
        return {"quant_cfg": entries, "algorithm": mtq.NVFP4_EXPERTS_ONLY_CFG.get("algorithm", "max")}
    for ent in entries:
        name = str(ent.get("quantizer_name", ""))
        if name.endswith("weight_quantizer") and isinstance(ent.get("cfg"), dict):
            ent["cfg"]["block_sizes"]["type"] = "static"  # block amaxes become calibrated state
            ent["cfg"].pop("effective_bits", None)
    algorithm = (mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG if local_hessian else mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)[
        "algorithm"
    ]
    return {"quant_cfg": entries, "algorithm": copy.deepcopy(algorithm)}


class ModelOptLayer:
    """ModelOpt's calibration of one decoder layer's routed experts."""

    def __init__(self, mse: bool, local_hessian: bool = False) -> None:
        self.mse = mse
        self.local_hessian = local_hessian
        self.experts: torch.nn.Module | None = None
        self.input_scales: dict[str, torch.Tensor | None] = {}
        self.hooks: list[Recorder] = []
        self.batch_hooks: list[Callable[[torch.Tensor], None]] = []

    def calibrate(
        self, layer: torch.nn.Module, streamer: LayerStreamer, store: HiddenStore, seq: int, batch: int
    ) -> None:
        import modelopt.torch.quantization as mtq

        def forward_loop(m: torch.nn.Module) -> None:
            n = store.shape[0]
            with torch.no_grad():
                for b0 in range(0, n, batch):
                    b1 = min(n, b0 + batch)
                    x = store.read(b0, b1).to(streamer.device, streamer.dtype)
                    m(x, position_embeddings=streamer.position_embeddings(b1 - b0, seq), attention_mask=None)

        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

        with _quiet():
            mtq.quantize(layer, modelopt_config(self.mse, self.local_hessian), forward_loop=forward_loop)
            ex = layer.mlp.experts
            if not hasattr(ex, "gate_up_proj_weight_quantizers"):
                raise PlanError(
                    "ModelOpt did not wrap the layer's fused experts",
                    got=type(ex).__name__,
                    hint="needs nvidia-modelopt with _QuantFusedExperts (0.47)",
                )
            # export reads the activation scales of enabled quantizers only: take them before disabling
            self.input_scales = {
                q: NVFP4QTensor.get_activation_scaling_factor(getattr(ex, q))
                for q in ("gate_up_proj_input_quantizer", "down_proj_input_quantizer")
            }
            mtq.disable_quantizer(layer, "*")  # the propagating forward stays BF16 (same as rtn)
        self.experts = ex

    def _input_scale(self, name: str, fallback_amax: torch.Tensor) -> torch.Tensor:
        """ModelOpt's shared input scale; a layer whose experts saw no token at all (no amax): qtool's
        fallback amaxes."""

        s = self.input_scales.get(name)
        if s is None:
            return nvfp4.input_scale_from_amax(fallback_amax.float()).reshape(-1)
        return s.float().reshape(()).expand(fallback_amax.shape[0]).clone()

    def nvfp4_chunk(
        self,
        first_expert: int,
        end_expert: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        in_amax: torch.Tensor,
        mid_amax: torch.Tensor,
    ) -> dict[str, NVFP4Experts]:
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

        ex = self.experts
        assert ex is not None  # calibrate() ran
        inter = gate_up.shape[1] // 2
        out: dict[str, list] = {p: [] for p in PARTS}
        for k, e in enumerate(range(first_expert, end_expert)):
            for fused, quantizer, w in (
                ("gate_up", ex.gate_up_proj_weight_quantizers[e], gate_up[k]),
                ("down", ex.down_proj_weight_quantizers[e], down[k]),
            ):
                ws2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer).float().reshape(())
                bs, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, ws2)
                bs = bs.to(torch.float8_e4m3fn)
                if fused == "gate_up":
                    for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                        q = nvfp4.quantize(w[rows], weight_scale_2=ws2, block_scale=bs[rows].contiguous())
                        out[part].append((q.packed, q.block_scale, ws2))
                else:
                    q = nvfp4.quantize(w, weight_scale_2=ws2, block_scale=bs.contiguous())
                    out["down_proj"].append((q.packed, q.block_scale, ws2))
        in_s = self._input_scale("gate_up_proj_input_quantizer", in_amax)
        mid_s = self._input_scale("down_proj_input_quantizer", mid_amax)
        return {
            p: NVFP4Experts(
                torch.stack([r[0] for r in rows]),
                torch.stack([r[1] for r in rows]),
                torch.stack([r[2] for r in rows]),
                mid_s if p == "down_proj" else in_s,
            )
            for p, rows in out.items()
        }


# ----------------------------------------------------------------------------------------- llmcompressor


def _weight_module(w: torch.Tensor) -> torch.nn.Module:
    """A module holding one expert projection's weight, for llm-compressor's fused observers (a function, not
    a torch.nn.Module subclass: torch is imported on first use, not with this module)."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(w, requires_grad=False)
    return module


class LlmCompressorLayer:
    """llm-compressor's observers + compressed-tensors' NVFP4 compressor on one layer's routed experts."""

    def __init__(self, mse: bool, n_experts: int) -> None:
        with _quiet():  # importing llm-compressor logs its device choice
            from compressed_tensors.quantization import preset_name_to_scheme
            from llmcompressor.observers import Observer

            self.scheme = preset_name_to_scheme("NVFP4", ["Linear"])
            self.weight_observer = "memoryless_mse" if mse else "memoryless_minmax"
            self.in_obs = [
                Observer.load_from_registry(
                    "static_minmax", base_name="input", args=copy.deepcopy(self.scheme.input_activations)
                )
                for _ in range(n_experts)
            ]
            self.mid_obs = [
                Observer.load_from_registry(
                    "static_minmax", base_name="input", args=copy.deepcopy(self.scheme.input_activations)
                )
                for _ in range(n_experts)
            ]
        self.hooks: list[Recorder] = []
        self.batch_hooks: list[Callable[[torch.Tensor], None]] = [self._observe_all]
        self.experts: torch.nn.Module | None = None

    def calibrate(
        self, layer: torch.nn.Module, streamer: LayerStreamer, store: HiddenStore, seq: int, batch: int
    ) -> None:
        """Nothing before the forward: the input observers are fed by the experts' forward (batch hook)."""
        self.experts = layer.mlp.experts

    def _observe_all(self, x: torch.Tensor) -> None:
        """llm-compressor's `moe_calibrate_all_experts` (oneshot's default; llmcompressor/modeling/moe/
        linear_experts.py): every expert runs on ALL tokens of the batch for its observers (the layer's
        output still uses the routed tokens only). Expert MLP as its linearized module computes it:
        down(act(gate(x)) * up(x)) with separate gate/up Linears."""
        import torch.nn.functional as F

        ex = self.experts
        assert ex is not None  # calibrate() ran
        inter = ex.gate_up_proj.shape[1] // 2
        with torch.no_grad():
            for e in range(ex.gate_up_proj.shape[0]):
                w = ex.gate_up_proj[e]
                mid = ex.act_fn(F.linear(x, w[:inter])) * F.linear(x, w[inter:])
                self.in_obs[e](x)
                self.mid_obs[e](mid)

    def _input_global(self, observers: list, e0: int, e1: int, fallback_amax: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.quantization.utils import generate_gparam

        out = []
        for k, e in enumerate(range(e0, e1)):
            obs = observers[e]
            if obs.has_statistics:
                out.append(obs.get_global_scale().float().reshape(()))
            else:  # the layer saw no token at all: qtool's fallback amax (never NaN)
                a = fallback_amax[k].float().reshape(1)
                out.append(generate_gparam(-a, a).float().reshape(()))
        return torch.stack(out)

    def nvfp4_chunk(
        self,
        first_expert: int,
        end_expert: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        in_amax: torch.Tensor,
        mid_amax: torch.Tensor,
    ) -> dict[str, NVFP4Experts]:
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from llmcompressor.observers import Observer
        from llmcompressor.observers.fusion import FusionHandler

        inter = gate_up.shape[1] // 2
        rows: dict[str, list] = {p: [] for p in PARTS}
        with _quiet():
            for k in range(end_expert - first_expert):
                mods = {
                    "gate_proj": _weight_module(gate_up[k, :inter]),
                    "up_proj": _weight_module(gate_up[k, inter:]),
                    "down_proj": _weight_module(down[k]),
                }
                obs = {
                    p: Observer.load_from_registry(
                        self.weight_observer, base_name="weight", args=copy.deepcopy(self.scheme.weights)
                    )
                    for p in mods
                }
                FusionHandler.fuse([(obs[p], mods[p]) for p in ("gate_proj", "up_proj")])
                for p, mod in mods.items():
                    obs[p](mod.weight)
                qp = {p: obs[p].get_qparams() for p in mods}
                for p, mod in mods.items():
                    sd = {
                        "weight": mod.weight.data,
                        "weight_scale": qp[p]["scale"],
                        "weight_global_scale": qp[p]["global_scale"],
                    }
                    c = NVFP4PackedCompressor.compress(sd, self.scheme)
                    rows[p].append(
                        (
                            c["weight_packed"],
                            c["weight_scale"].to(torch.float8_e4m3fn),
                            qp[p]["global_scale"].float().reshape(()),
                        )
                    )
        g_in = self._input_global(self.in_obs, first_expert, end_expert, in_amax)
        g_mid = self._input_global(self.mid_obs, first_expert, end_expert, mid_amax)
        one = torch.tensor(1.0, dtype=torch.float32)
        res = {}
        for p, r in rows.items():
            gw = torch.stack([x[2] for x in r])
            gi = g_mid if p == "down_proj" else g_in
            res[p] = NVFP4Experts(
                torch.stack([x[0] for x in r]),
                torch.stack([x[1] for x in r]),
                one / gw,
                one / gi,
                weight_global_scale=gw,
                input_global_scale=gi,
            )
        return res


# ------------------------------------------------------------------------------------------------ dispatch


def _modelopt(plan: QuantizePlan) -> ModelOptLayer:
    scale = plan.recipe.nvfp4.weight_scale
    return ModelOptLayer(scale is WeightScale.MSE, local_hessian=scale is WeightScale.LOCAL_HESSIAN)


def _llmcompressor(plan: QuantizePlan) -> LlmCompressorLayer:
    return LlmCompressorLayer(plan.recipe.nvfp4.weight_scale is WeightScale.MSE, plan.n_experts)


# the backends plan.PEER_BACKENDS names, each with its per-layer state
LAYER_BACKENDS: dict[Backend, Callable[[QuantizePlan], LayerBackend]] = {
    Backend.MODELOPT: _modelopt,
    Backend.LLMCOMPRESSOR: _llmcompressor,
}


def for_layer(plan: QuantizePlan) -> LayerBackend | None:
    """A fresh per-layer backend state for `plan`, or None for rtn (qtool's own codec)."""
    make = LAYER_BACKENDS.get(plan.backend)
    return None if make is None else make(plan)
