"""`qtool quantize` plan: from headers, configs and the recipe only (no tensor data).

Decides, per decoder layer, the scheme of the routed experts (recipe groups + layer overrides), the names
dtypes and shapes of every output tensor, where each comes from (a byte range of the source, or computed),
and the memory the run needs. Validates before any work: a BF16 source, experts present in every layer,
in-features the scheme can encode, a format that can carry the scheme, a backend that supports it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from qtool import dist
from qtool.arch.model_map import Format, ModelMap
from qtool.arch.qwen35 import Group, layer_prefix
from qtool.errors import PlanError, UsageError
from qtool.extras import require
from qtool.formats.awq import effective_group_size, expert_group_size
from qtool.io.checkpoint import Checkpoint
from qtool.io.dtypes import nbytes_for
from qtool.io.output import OutputDir
from qtool.io.plan import OutputPlan
from qtool.io.writer import FileRange
from qtool.ops.quantize import output as quantize_output
from qtool.ops.quantize.coverage import floor_warning, refuse_peer_backend
from qtool.ops.quantize.hessians import gptq_memory_bytes
from qtool.ops.quantize.schemes import fp8_linears, fp8_params
from qtool.recipes import FORMATS_FOR, Backend, KvCache, OutFormat, Recipe, Scheme, WeightScale, load_recipe
from qtool.stream.calib_data import CalibSet, plan_calibration
from qtool.stream.layer_stream import LayerStreamer, StreamPlan
from qtool.stream.memory_plan import MemoryNeed, need

if TYPE_CHECKING:
    import torch

PARTS = ("down_proj", "gate_proj", "up_proj")  # header order of one expert's modules (sorted names)
LAYER_SHARD = "model-layer-{:05d}.safetensors"

# Output params of one quantized expert Linear, per (scheme, format): name -> (dtype, shape fn(out, in, g)).
ShapeOf = Callable[[int, int, int], tuple[int, ...]]
QUANT_PARAMS: dict[tuple[Scheme, OutFormat], tuple[tuple[str, str, ShapeOf], ...]] = {
    # ModelOpt (modelopt/torch/export/unified_export_hf.py, docs/formats.md §3)
    (Scheme.NVFP4, OutFormat.MODELOPT): (
        ("input_scale", "F32", lambda o, i, g: ()),
        ("weight", "U8", lambda o, i, g: (o, i // 2)),
        ("weight_scale", "F8_E4M3", lambda o, i, g: (o, i // 16)),
        ("weight_scale_2", "F32", lambda o, i, g: ()),
    ),
    # compressed-tensors nvfp4-pack-quantized (docs/formats.md §4)
    (Scheme.NVFP4, OutFormat.COMPRESSED_TENSORS): (
        ("input_global_scale", "F32", lambda o, i, g: (1,)),
        ("weight_global_scale", "F32", lambda o, i, g: (1,)),
        ("weight_packed", "U8", lambda o, i, g: (o, i // 2)),
        ("weight_scale", "F8_E4M3", lambda o, i, g: (o, i // 16)),
    ),
    # compressed-tensors pack-quantized INT4 (compressors/quantized_compressors/pack_quantized.py)
    (Scheme.W4A16, OutFormat.COMPRESSED_TENSORS): (
        ("weight_packed", "I32", lambda o, i, g: (o, i // 8)),
        ("weight_scale", "BF16", lambda o, i, g: (o, i // g)),
        ("weight_shape", "I64", lambda o, i, g: (2,)),
    ),
    # AutoAWQ GEMM (docs/formats.md §5)
    (Scheme.W4A16, OutFormat.AWQ): (
        ("qweight", "I32", lambda o, i, g: (i, o // 8)),
        ("qzeros", "I32", lambda o, i, g: (i // g, o // 8)),
        ("scales", "F16", lambda o, i, g: (i // g, o)),
    ),
}


DEFAULT_SAMPLES = 16


class Spec(NamedTuple):
    """One output tensor: copied from `source` (FileRange) or computed (source None). A tuple, not a
    dataclass: the 397B's plan makes 372k of them (a frozen dataclass's __init__ took ~1 us each)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: FileRange | None = None

    @property
    def nbytes(self) -> int:
        return nbytes_for(self.dtype, self.shape) or 0


@dataclass
class LayerPlan:
    index: int
    scheme: Scheme
    full_attention: bool
    specs: list[Spec]
    shard: str
    fp8: tuple[str, ...] = ()  # the dense linears coded FP8 (names relative to the layer; ops.quantize.schemes)


# the calibration set's hidden states on disk: the layer running reads one file and writes another, and the
# input of each layer still being written behind stays intact for a resume from the journal, which names it
# (qtool.stream.hidden_store.DiskStore): two files, plus one per layer in flight (at most two)
HIDDEN_FILES = 4
# The peer libraries' backends (qtool.ops.quantize.backends.LAYER_BACKENDS, which dispatches them): they
# calibrate and code a layer on the loop's thread (their state is not thread-safe), so nothing is written behind
PEER_BACKENDS = frozenset({Backend.MODELOPT, Backend.LLMCOMPRESSOR})
HEADROOM = 0.9  # two layers in flight only within this share of the free memory


@dataclass
class QuantizePlan:
    ckpt: Checkpoint
    model_map: ModelMap
    recipe: Recipe
    backend: Backend
    format: OutFormat
    out: Path
    layers: list[LayerPlan]
    rest: list[Spec]
    n_experts: int
    inter: int
    hidden: int
    samples: int
    seq_len: int
    dataset: str
    device: str
    stream: StreamPlan
    awq_rows: int
    warnings: list[str] = field(default_factory=list)
    options: QuantizeOptions | None = None
    output: OutputPlan | None = None  # every output file, once make_output() has run
    # the output's model map as it will be written in OUT.partial (made with the output plan: its configs'
    # ignore lists come from it, and the output's checks, qtool.ops.checks.PlannedProblems)
    output_map: ModelMap | None = None
    calib: CalibSet | None = None  # the token windows; None with calib_ids
    memory: MemoryNeed | None = None  # peak host/GPU need and fit (set by plan())
    int4_group: int = 128  # W4A16: the one group size of every expert projection (formats.awq.expert_group_size)
    layers_in_flight: int = 1  # finished layers coded and written at once behind the forward (execute)

    @property
    def layers_run(self) -> int:
        """The decoder layers the job runs (its progress's total)."""
        return len(self.layers)

    @property
    def kv_names(self) -> str:
        return "modelopt" if self.format is OutFormat.MODELOPT else "compressed-tensors"

    def memory_need(self, in_flight: int | None = None) -> MemoryNeed:
        """Peak host/GPU memory (qtool.stream.memory_plan): with qtool's own codec finished layers are
        quantized and written behind the next one (`in_flight` of them, default the plan's), so that many
        dense layers more are held."""
        write_behind = self.backend not in PEER_BACKENDS and not self.recipe.gptq.enabled  # GPTQ: hessians.py
        held = 1 + (self.layers_in_flight if in_flight is None else in_flight) if write_behind else 1
        return need(
            self.stream,
            device=self.device,
            held_layers=held,
            extra_host=self.awq_activation_bytes,
            extra_device=self.gptq_bytes,
            ranks=dist.planned_ranks(),
        )

    @property
    def gptq_bytes(self) -> int:
        """What GPTQ keeps on each rank's device beside the layer (hessians.gptq_memory_bytes), else 0."""
        if not self.recipe.gptq.enabled:
            return 0
        return gptq_memory_bytes(self.n_experts, self.hidden, self.inter, dist.planned_ranks())

    @property
    def awq_activation_bytes(self) -> int:
        """A layer's down_proj input rows kept for the AWQ search, in the forward's dtype (calib.ExpertStats)."""
        return self.n_experts * self.awq_rows * self.inter * self.stream.itemsize

    def choose_layers_in_flight(self) -> int:
        """Two finished layers coded and written at once, where that fits: a layer's shard is written by one
        thread, and one thread's buffered writes copy at ~2 GB/s on the lent H200 machine (the page cache of
        its /dev/shm, and the users' NVMe alike: the copy, not the disk, is the limit), so two shards written
        side by side write twice as fast. Not with a peer backend (no write-behind), with several ranks (their
        shares meet layer by layer), nor where the AWQ search keeps each layer's activations on the host."""
        if self.backend in PEER_BACKENDS or self.awq_rows or dist.planned_ranks() > 1 or self.recipe.gptq.enabled:
            return 1
        # with room to spare: the allocator holds more than it hands out, and two coders' temporaries
        return 1 if self.memory_need(2).problems_within(HEADROOM) else 2

    def make_output(self) -> OutputPlan:
        """The output plan (quantize.output.output_plan), made once. An executing run makes it while its
        first layer is read (execute): it is per-tensor Python, 3 s for the 397B's 372k output tensors on
        the 2-core VM, that delayed the first read. A dry run's to_json makes it too, so that a dry run
        refuses what the run would."""
        if self.output is None:
            self.output = quantize_output.output_plan(self)
        return self.output

    def to_json(self) -> dict:
        assert self.memory is not None  # plan() sets it
        output = self.make_output()
        return {
            "checkpoint": str(self.ckpt.root),
            "output": str(self.out),
            "recipe": self.recipe.to_json(),
            "backend": self.backend.value,
            "format": self.format.value,
            "layers": [
                {
                    "layer": layer_plan.index,
                    "routed_experts": layer_plan.scheme.value,
                    "full_attention": layer_plan.full_attention,
                    "tensors": len(layer_plan.specs),
                    "shard": layer_plan.shard,
                }
                for layer_plan in self.layers
            ],
            "carried_over_tensors": len(self.rest),
            "output_bytes": output.summary["bytes"],
            "output_shards": output.summary["shards"],
            "source_bytes": self.ckpt.total_bytes() if hasattr(self.ckpt, "total_bytes") else None,
            "calibration": self.calib.to_json()
            if self.calib is not None
            else {
                "dataset": self.dataset,
                "samples": self.samples,
                "seq_len": self.seq_len,
                "tokens": self.samples * self.seq_len,
            },
            "device": self.device,
            "memory": {
                **self.stream.to_json(),
                "awq_activation_bytes": self.awq_activation_bytes,
                "need": self.memory.to_json(),
                "hidden_disk_bytes": HIDDEN_FILES * self.stream.hidden_bytes,
                "layers_in_flight": self.layers_in_flight,
            },
            "warnings": self.warnings,
        }


def group_of(inner: Group) -> str:
    return inner.value


def expert_specs(
    prefix: str, expert: int, scheme: Scheme, fmt: OutFormat, hidden: int, inter: int, group: int
) -> list[Spec]:
    base = f"{prefix}mlp.experts.{expert}."
    return [Spec(base + tail, dt, shape) for tail, dt, shape in _expert_params(scheme, fmt, hidden, inter, group)]


@lru_cache(maxsize=64)
def _expert_params(
    scheme: Scheme, fmt: OutFormat, hidden: int, inter: int, group: int
) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """One quantized expert's output tensors as (name after `experts.E.`, dtype, shape): the same for all
    experts, so made once (the 397B's plan asks 30,720 times)."""
    out = []
    for part in PARTS:
        o, i = (hidden, inter) if part == "down_proj" else (inter, hidden)
        g = effective_group_size(i, group) if scheme is Scheme.W4A16 else 16
        for name, dt, shp in QUANT_PARAMS[(scheme, fmt)]:
            out.append((f"{part}.{name}", dt, tuple(shp(o, i, g))))
    return tuple(out)


def _bf16_expert_specs(model_map: ModelMap, prefix: str, e: int, hidden: int, inter: int) -> list[Spec]:
    """Per-expert BF16 weights as byte ranges: the per-expert tensors themselves, or slices of the fused
    [E, 2I, H] / [E, H, I] tensors (each expert's gate rows, up rows and down matrix are contiguous)."""
    t = model_map.ckpt.tensors
    out = []
    fused_gu = t.get(prefix + "mlp.experts.gate_up_proj")
    for part in PARTS:
        name = f"{prefix}mlp.experts.{e}.{part}.weight"
        if name in t:
            i = t[name]
            out.append(Spec(name, i.dtype, tuple(i.shape), FileRange(i.file, i.start, i.end)))
            continue
        if fused_gu is None:
            raise PlanError("routed expert weight missing", path=model_map.ckpt.root, tensor=name)
        item = fused_gu.nbytes // (fused_gu.shape[0] * fused_gu.shape[1] * fused_gu.shape[2])
        if part == "down_proj":
            d = t[prefix + "mlp.experts.down_proj"]
            size = hidden * inter * item
            start = d.start + e * size
            out.append(Spec(name, d.dtype, (hidden, inter), FileRange(d.file, start, start + size)))
        else:
            size = inter * hidden * item
            start = fused_gu.start + e * 2 * size + (size if part == "up_proj" else 0)
            out.append(Spec(name, fused_gu.dtype, (inter, hidden), FileRange(fused_gu.file, start, start + size)))
    return out


def kv_scale_names(prefix: str, fmt: OutFormat) -> tuple[str, str]:
    # ModelOpt: self_attn.k_proj.k_scale (unified_export_hf.py); compressed-tensors: self_attn.k_scale.
    if fmt is OutFormat.MODELOPT:
        return prefix + "self_attn.k_proj.k_scale", prefix + "self_attn.v_proj.v_scale"
    return prefix + "self_attn.k_scale", prefix + "self_attn.v_scale"


def _layer_tensors(names: list[str], prefix: str) -> list[str]:
    """The names in sorted `names` that start with `prefix`: one contiguous run, found by bisection (a scan
    per layer over the 397B's tensors, ~280k for a per-expert source, took seconds). It ends before the
    first name not below `prefix` with its last character incremented."""
    after = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return names[bisect_left(names, prefix) : bisect_left(names, after)]


def _fp8_linears(ckpt: Checkpoint, recipe: Recipe, idx: int, prefix: str, in_layer: list[str]) -> list[str]:
    """The layer's linears the recipe codes FP8 (relative names); each must be a BF16 2-D weight."""
    present = {n[len(prefix) : -len(".weight")] for n in in_layer if n.endswith(".weight")}
    fp8 = fp8_linears(recipe, idx, present)
    for rel in fp8:
        info = ckpt.tensors[prefix + rel + ".weight"]
        if info.dtype not in ("BF16", "F16", "F32") or len(info.shape) != 2:
            raise PlanError(
                "quantize needs a BF16 source; a linear the recipe codes fp8 is not BF16",
                path=ckpt.root,
                tensor=prefix + rel + ".weight",
                got=info.dtype,
                hint="start from the BF16 original",
            )
    return fp8


def _refuse_fp8_runs(recipe: Recipe, backend: Backend) -> None:
    """FP8 groups are coded by qtool's own codec, in one process (their input amaxes are not reduced over
    ranks)."""
    if Scheme.FP8 not in recipe.schemes:
        return
    if backend is not Backend.RTN:
        raise UsageError(
            f"--backend {backend.value} does not code the recipe's fp8 groups (qtool's own codec does)",
            hint="use --backend rtn (the default)",
        )
    _one_process_only("a recipe with fp8 groups", "the fp8 linears' input amaxes are not reduced over ranks yet")


def _refuse_local_hessian_runs(recipe: Recipe, backend: Backend) -> None:
    """llm-compressor has no local-Hessian search; ModelOpt's (--backend modelopt) is its oracle. With several
    ranks qtool's own runs every window on every rank (stage.QuantizeStage.every_window): the same bytes."""
    if recipe.nvfp4.weight_scale is WeightScale.LOCAL_HESSIAN and backend is Backend.LLMCOMPRESSOR:
        raise UsageError(
            "nvfp4.weight_scale local_hessian: --backend llmcompressor has no local-Hessian block-scale search",
            hint="use --backend rtn (qtool's own, the default) or --backend modelopt (ModelOpt's)",
        )


def _refuse_gptq_runs(recipe: Recipe, backend: Backend) -> None:
    """GPTQ is qtool's own coder (with any number of ranks: qtool.ops.quantize.gptq_layer)."""
    if recipe.gptq.enabled and backend is not Backend.RTN:
        raise UsageError(
            f"--backend {backend.value} does not run the recipe's gptq (qtool's own coder does)",
            hint="use --backend rtn (the default), or drop the recipe's gptq mapping",
        )


def _one_process_only(what: str, why: str) -> None:
    """Refuse `what` with several ranks (--nproc/--devices), saying why."""
    if dist.planned_ranks() > 1:
        raise UsageError(f"{what} runs in one process ({why})", hint="run without --nproc/--devices")


@dataclass(frozen=True)
class QuantizeOptions:
    """quantize's options: the one place their defaults live (CLI, build steps, library)."""

    checkpoint: Path
    out: Path
    recipe: Recipe
    backend: Backend | None = None  # default: the recipe's
    format: OutFormat | None = None  # default: the recipe's
    dataset: str = "builtin"
    samples: int | None = None  # calibration windows (None: DEFAULT_SAMPLES, or fewer if the dataset is short)
    seq_len: int = 512
    device: str = "cpu"
    awq_rows: int = 256
    force: bool = False
    resume: bool = False
    command: str | None = None
    calib_ids: torch.Tensor | None = None  # [N, L] token ids instead of dataset/samples/seq_len (library use)
    batch_tokens: int | None = None  # tokens per micro-batch (default: the layer streamer's)

    def __post_init__(self) -> None:
        # the values a build recipe's `with` (or a caller) gives as text become their types here
        set_ = object.__setattr__
        set_(self, "checkpoint", Path(self.checkpoint))
        set_(self, "out", Path(self.out))
        if isinstance(self.recipe, str):
            set_(self, "recipe", load_recipe(self.recipe))
        if isinstance(self.backend, str):
            set_(self, "backend", Backend(self.backend))
        if isinstance(self.format, str):
            set_(self, "format", OutFormat(self.format))


def plan(opts: QuantizeOptions) -> QuantizePlan:
    recipe, out, device, awq_rows, dataset = opts.recipe, opts.out, opts.device, opts.awq_rows, opts.dataset
    samples, seq_len = opts.samples, opts.seq_len
    ckpt = Checkpoint.open(opts.checkpoint, require_config=True)
    if opts.calib_ids is not None:
        samples, seq_len = int(opts.calib_ids.shape[0]), int(opts.calib_ids.shape[1])
    backend = opts.backend or recipe.backend
    fmt = opts.format or recipe.format
    streamer = LayerStreamer(ckpt, device=device, batch_tokens=opts.batch_tokens)
    model_map = streamer.model_map
    outp = Path(out)
    # the output is refused here, before the dataset is read below (with hf: a download), as every other
    # refusal that needs no data; execute's transaction checks it again under its lock
    OutputDir(outp, sources=[ckpt.root], force=opts.force, resume=opts.resume).check()
    scheme = recipe.quantized_scheme
    for held in sorted(recipe.schemes, key=lambda x: x is not scheme):  # the experts' scheme's refusal first
        if fmt not in FORMATS_FOR[held]:
            raise UsageError(
                f"--format {fmt.value} cannot hold {held.value} weights",
                expected=[f.value for f in FORMATS_FOR[held]],
                got=fmt.value,
                hint=f"drop --format (the recipe's own is used), give --format "
                f"{' or '.join(f.value for f in FORMATS_FOR[held])}, or a recipe of that format "
                "(`qtool recipes` lists them)",
            )
    _refuse_fp8_runs(recipe, backend)
    refuse_peer_backend(recipe, backend)
    _refuse_local_hessian_runs(recipe, backend)
    static_scales = (WeightScale.MSE, WeightScale.LOCAL_HESSIAN)
    if backend is Backend.MODELOPT and recipe.nvfp4.weight_scale in static_scales and not device.startswith("cuda"):
        # ModelOpt 0.47's static NVFP4 weight quantizer fake-quantizes through a Triton kernel only:
        # modelopt/torch/quantization/tensor_quant.py:586 raises "static_blockwise_fp4_fake_quant requires
        # triton" during mse_calibrate when triton_kernel.IS_AVAILABLE is False (always on a CPU).
        raise UsageError(
            f"--backend modelopt with nvfp4.weight_scale {recipe.nvfp4.weight_scale.value} needs a CUDA device "
            "(ModelOpt's static NVFP4 fake-quant, used by its MSE and local-Hessian calibration, is a Triton kernel)",
            hint="use --device cuda, or --backend rtn / llmcompressor for MSE weight scales on CPU",
        )
    own_codecs = (WeightScale.MSE_SWEEP, WeightScale.FOUR_OVER_SIX)
    if recipe.nvfp4.weight_scale in own_codecs and backend is not Backend.RTN:
        # the peers' own runs of these searches are the oracle in the tests, not a backend of qtool's
        raise UsageError(
            f"nvfp4.weight_scale {recipe.nvfp4.weight_scale.value} is qtool's own codec: "
            f"--backend {backend.value} does not run it",
            hint="use --backend rtn (the default)",
        )
    if backend is Backend.MODELOPT:
        require("modelopt", "--backend modelopt")
    elif backend is Backend.LLMCOMPRESSOR:
        require("llmcompressor", "--backend llmcompressor")
    if backend is not Backend.RTN and dist.planned_ranks() > 1:
        raise UsageError(
            f"--backend {backend.value} runs in one process (the peer library's calibration state is "
            "not reduced over ranks)",
            hint="use --backend rtn with --nproc/--devices, or one process",
        )
    _refuse_gptq_runs(recipe, backend)
    if backend is not Backend.RTN and scheme is not Scheme.NVFP4:
        raise UsageError(
            f"--backend {backend.value} drives the peer's NVFP4 calibration only",
            got=scheme.value,
            hint="use --backend rtn for W4A16 recipes (qtool's AWQ search + INT4 codec)",
        )
    tc = ckpt.text_config
    hidden, inter, n_exp = int(tc["hidden_size"]), int(tc["moe_intermediate_size"]), int(tc["num_experts"])
    qmods = [
        m
        for m in model_map.modules.values()
        if not m.is_mtp and m.inner is Group.ROUTED_EXPERTS and m.format is not None
    ]
    bad = [m for m in qmods if m.format is not Format.BF16]
    if bad:
        assert bad[0].format is not None  # (qmods have one)
        raise PlanError(
            "quantize needs a BF16 source; routed experts are already quantized",
            path=ckpt.root,
            tensor=bad[0].name,
            got=bad[0].format.value,
            hint="start from the BF16 original",
        )
    if scheme is Scheme.NVFP4 and (hidden % 16 or inter % 16):
        raise PlanError("NVFP4 needs expert in-features divisible by 16", got=(hidden, inter))
    int4_group, group_note = recipe.int4.group_size, None
    if scheme is Scheme.W4A16:
        int4_group = expert_group_size([hidden, inter], recipe.int4.group_size)  # one for all projections
        if int4_group != recipe.int4.group_size:
            group_note = (
                f"INT4 group size {int4_group} for every expert projection (the recipe's "
                f"{recipe.int4.group_size} exceeds an in-features; the engines need one scheme for all "
                "MoE projections)"
            )
        if fmt is OutFormat.AWQ and (hidden % 8 or inter % 8):
            raise PlanError("AutoAWQ GEMM needs out-features divisible by 8", got=(hidden, inter))
    layers = []
    kv_names_existing = {n for n in model_map.kv_scale_tensors() if not n.startswith("mtp.")}
    names = sorted(ckpt.tensors)
    for idx in range(model_map.num_layers):
        prefix = layer_prefix(idx, model_map.naming)
        s = recipe.scheme_for("routed_experts", idx)
        specs = []
        has_experts = False
        in_layer = _layer_tensors(names, prefix)
        fp8 = _fp8_linears(ckpt, recipe, idx, prefix, in_layer)
        fp8_weights = {prefix + rel + ".weight" for rel in fp8}
        for n in in_layer:
            if model_map.roles[n].inner is Group.ROUTED_EXPERTS:
                has_experts = True
                continue
            if n in kv_names_existing:
                continue
            i = ckpt.tensors[n]
            if n in fp8_weights:  # coded: its FP8 weight and scales take the BF16 weight's place
                module = n[: -len(".weight")]
                specs += [Spec(f"{module}.{param}", dt, shp) for param, dt, shp in fp8_params(fmt, *i.shape)]
                continue
            specs.append(Spec(n, i.dtype, tuple(i.shape), FileRange(i.file, i.start, i.end)))
        if not has_experts:
            raise PlanError(
                f"decoder layer {idx} has no routed experts", path=ckpt.root, expected=prefix + "mlp.experts.*"
            )
        for e in range(n_exp):
            if s is Scheme.BF16:
                specs += _bf16_expert_specs(model_map, prefix, e, hidden, inter)
            else:
                specs += expert_specs(prefix, e, s, fmt, hidden, inter, int4_group)
        full = idx in model_map.full_attention
        if full and recipe.kv_cache is KvCache.FP8 and fmt is not OutFormat.AWQ:
            specs += [Spec(n, "F32", ()) for n in kv_scale_names(prefix, fmt)]
        layers.append(LayerPlan(idx, s, full, specs, LAYER_SHARD.format(idx), tuple(fp8)))
    layer_pre = tuple(layer_prefix(i, model_map.naming) for i in range(model_map.num_layers))
    rest = []
    for n in names:
        if n.startswith(layer_pre) and not n.startswith("mtp."):
            continue
        i = ckpt.tensors[n]
        if n.startswith("mtp.") and n.endswith(".mlp.experts.down_proj"):
            continue  # split with its gate_up_proj below
        if n.startswith("mtp.") and n.endswith(".mlp.experts.gate_up_proj"):
            # the MTP head's fused experts: per expert, by byte range (docs/formats.md §2: engines
            # mis-load fused MTP experts next to per-expert decoder layers); the decoder layers' code path
            prefix = n[: -len("mlp.experts.gate_up_proj")]
            for e in range(int(i.shape[0])):
                rest += _bf16_expert_specs(model_map, prefix, e, hidden, inter)
            continue
        rest.append(Spec(n, i.dtype, tuple(i.shape), FileRange(i.file, i.start, i.end)))
    rest.sort(key=lambda sp: sp.name)
    warnings = [group_note] if group_note else []
    if model_map.expert_layout == "fused":
        warnings.append("source experts are fused; the output is per expert (BF16 experts split by byte range)")
    if not any(n.startswith("mtp.") for n in ckpt.tensors):
        warnings.append("the source has no mtp.* head; the output has none either (speculative decoding needs it)")
    if fmt is OutFormat.AWQ and recipe.kv_cache is KvCache.FP8:
        warnings.append(
            "AutoAWQ form: no KV scales written (the awq config has no kv_cache_scheme and vLLM's AWQ "
            "method loads none); use --format compressed-tensors for FP8 KV scales"
        )
    keep = awq_rows if (scheme is Scheme.W4A16 and recipe.int4.awq) else 0
    calib = None
    if opts.calib_ids is None:
        # the windows, from the dataset: only now, after every refusal that needs no data. The default is 16
        # windows, or as many as the dataset gives (the builtin corpus is a short sample: 5.8k tokens with the
        # 397B's tokenizer; the recipe's calibration warning below says what a real run uses); an explicit
        # --samples too large for the data is refused here
        calib = plan_calibration(
            ckpt, dataset, DEFAULT_SAMPLES if samples is None else samples, seq_len, at_most=samples is None
        )
        samples = calib.samples
    assert samples is not None  # from calib_ids, or the windows planned
    quantize_plan = QuantizePlan(
        ckpt,
        model_map,
        recipe,
        backend,
        fmt,
        outp,
        layers,
        rest,
        n_exp,
        inter,
        hidden,
        samples,
        seq_len,
        dataset,
        device,
        streamer.plan(samples, seq_len),
        keep,
        warnings,
        opts,
        int4_group=int4_group,
    )
    quantize_plan.calib = calib
    want = recipe.calibration
    if want and (dataset != want["dataset"] or samples * seq_len < want["samples"] * want["seq_len"]):
        quantize_plan.warnings.append(
            f"the recipe {recipe.name} is meant to calibrate on {want['dataset']} "
            f"({want['samples']} x {want['seq_len']} tokens); this run uses {dataset} "
            f"({samples} x {seq_len}): pass --dataset/--samples/--seq-len for a real run"
        )
    thin = floor_warning(recipe, samples * seq_len, int(tc.get("num_experts_per_tok") or 1), n_exp)
    if thin:
        quantize_plan.warnings.append(thin)
    quantize_plan.layers_in_flight = quantize_plan.choose_layers_in_flight()
    quantize_plan.memory = quantize_plan.memory_need()
    if memory_warning := quantize_plan.memory.warning():
        quantize_plan.warnings.append(memory_warning)
    return quantize_plan  # its output plan: make_output()
