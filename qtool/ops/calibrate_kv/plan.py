"""calibrate-kv: options and plan (headers and configs only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.dist import planned_ranks
from qtool.io.output import OutputDir
from qtool.ops.calibrate_kv.write import output_plan
from qtool.stream.calib_data import plan_calibration
from qtool.stream.layer_stream import LayerStreamer

if TYPE_CHECKING:
    from qtool.io.plan import OutputPlan

from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.model_map import ModelMap
from qtool.arch.qwen35 import Group, layer_prefix
from qtool.errors import PlanError
from qtool.io.checkpoint import Checkpoint
from qtool.io.in_place import in_place_partial
from qtool.io.output import check_no_overlap, partial_path
from qtool.ops.calibrate_kv.scheme import Convention
from qtool.stream.memory_plan import need

OUTLIER_RATIO = 10.0
KV_SHARD = "model-kv-scales.safetensors"
JOURNAL = "journal.json"


def scale_names(layer: int, naming, conv: Convention) -> tuple[str, str]:
    p = layer_prefix(layer, naming) + "self_attn."
    if conv is Convention.MODELOPT:
        return p + "k_proj.k_scale", p + "v_proj.v_scale"
    return p + "k_scale", p + "v_scale"


# ---- plan ------------------------------------------------------------------------------------------


@dataclass
class KvPlan:
    ckpt: Checkpoint
    out: Path | None  # None = in place
    convention: Convention
    layers: list[int]  # full-attention layers to calibrate
    run_layers: int  # decoder layers to run (0..run_layers-1)
    names: dict[int, tuple[str, str]]
    remove: list[str]  # existing text-layer KV-scale tensors that the new ones replace
    rewrite_shards: list[str]  # shards that held removed tensors among others (rewritten without them)
    kv_shard: str
    work_dir: Path
    samples: int
    seq_len: int
    dataset: str
    device: str
    stream: object  # layer_stream.StreamPlan
    config_changes: list[str]
    warnings: list[str] = field(default_factory=list)
    options: CalibrateKvOptions | None = None
    output: OutputPlan | None = None  # every output file (calibrate_kv.write.output_plan)
    calib: object = None  # the token windows (stream.calib_data.CalibSet), made by the plan
    memory: object = None  # peak host/GPU need and fit (stream.memory_plan.MemoryNeed)
    mm: ModelMap | None = None  # the checkpoint's map (execute's layer streamer reuses it)

    @property
    def layers_run(self) -> int:
        """The decoder layers the job runs (its progress's total)."""
        return self.run_layers

    def to_json(self) -> dict:
        sp = self.stream
        return {
            "checkpoint": str(self.ckpt.root),
            "output": str(self.out) if self.out else "in-place",
            "convention": self.convention.value,
            "full_attention_layers": self.layers,
            "decoder_layers_run": self.run_layers,
            "scale_tensors": [n for pair in self.names.values() for n in pair],
            "replaces": self.remove,
            "rewrites_shards": self.rewrite_shards,
            "new_shard": self.kv_shard,
            "config_changes": self.config_changes,
            "calibration": self.calib.to_json()
            if self.calib is not None
            else {
                "dataset": self.dataset,
                "samples": self.samples,
                "seq_len": self.seq_len,
                "tokens": self.samples * self.seq_len,
            },
            "device": self.device,
            "work_dir": str(self.work_dir),
            "memory": {
                **sp.to_json(),
                "need": self.memory.to_json(),
                "hidden_disk_bytes": 2 * sp.hidden_bytes,
            },
            "warnings": self.warnings,
        }


def _convention(ckpt: Checkpoint, mm) -> Convention:
    if mm.kv.naming:
        return Convention(mm.kv.naming)
    qc = ckpt.quantization_config or {}
    if qc.get("quant_method") == "modelopt" or (not qc and ckpt.hf_quant_config):
        return Convention.MODELOPT
    return Convention.COMPRESSED_TENSORS


@dataclass(frozen=True)
class CalibrateKvOptions:
    """calibrate-kv's options: the one place their defaults live (CLI, build steps, library)."""

    checkpoint: Path
    out: Path | None = None  # None: in place
    dataset: str = "builtin"
    samples: int = 4  # calibration windows
    seq_len: int = 512
    device: str = "cpu"
    replace_scales: bool = False  # replace the KV scales the checkpoint already has
    force: bool = False  # replace an existing OUT that qtool made
    resume: bool = False
    command: str | None = None  # recorded in the manifest (secrets redacted by the caller)
    dtype: str | None = None  # compute dtype (default: the layer streamer's)
    batch_tokens: int | None = None  # tokens per micro-batch (default: the layer streamer's)


def plan(opts: CalibrateKvOptions) -> KvPlan:

    out, samples, seq_len, dataset, device = opts.out, opts.samples, opts.seq_len, opts.dataset, opts.device
    replace_scales, dtype = opts.replace_scales, opts.dtype
    ckpt = Checkpoint.open(opts.checkpoint, require_config=True)
    streamer = LayerStreamer(ckpt, device=device, dtype=dtype, batch_tokens=opts.batch_tokens)
    mm = streamer.model_map
    layers = list(mm.full_attention)
    if not layers:
        raise PlanError("the model has no full-attention layers (text_config.layer_types)", path=ckpt.root)
    conv = _convention(ckpt, mm)
    names = {i: scale_names(i, mm.naming, conv) for i in layers}
    existing = mm.kv_scale_tensors()
    if existing and not replace_scales:
        raise PlanError(
            f"the checkpoint already has {len(existing)} KV-scale tensor(s)",
            path=ckpt.root,
            tensor=existing[0],
            hint="pass --replace-scales to replace them",
        )
    by_shard: dict[str, list[str]] = {}
    for n in existing:
        by_shard.setdefault(ckpt.shard_of(n), []).append(n)
    rewrite = sorted(s for s, ns in by_shard.items() if len(ns) < len(ckpt.headers[s].tensors))
    # The new shard: reuse our own name when that shard holds nothing but scales we replace.
    kv_shard = KV_SHARD
    k = 1
    while kv_shard in ckpt.headers and kv_shard not in by_shard or kv_shard in rewrite:
        k += 1
        kv_shard = f"model-kv-scales-{k}.safetensors"
    out_p = Path(out) if out is not None else None
    if out_p is not None:
        check_no_overlap(out_p, [ckpt.root])

        # a user's own -o (or one --force may not replace) is refused now, before the dataset is read
        OutputDir(out_p, sources=[ckpt.root], force=opts.force, resume=opts.resume).check()
    # the hidden states and the journal live in the transaction's partial directory (-o and --in-place)
    work = (partial_path(out_p) if out_p is not None else in_place_partial(ckpt.root)) / ".calibrate-kv"
    changes = []
    qc = ckpt.quantization_config
    if isinstance(qc, dict):
        changes.append(f"config.json quantization_config.kv_cache_scheme = {conv.value} FP8 per-tensor")
    elif not ckpt.hf_quant_config:
        changes.append("config.json quantization_config = compressed-tensors KV-cache-only (llm-compressor form)")
    if ckpt.hf_quant_config:
        changes.append("hf_quant_config.json kv_cache_quant_algo = FP8")
    sp = streamer.plan(samples, seq_len)
    warnings = []
    if mm.kv.layers and set(mm.kv.layers) != set(layers):
        warnings.append(f"existing KV scales cover layers {mm.kv.layers}, full attention is {layers}")
    if mm.has_group(Group.MTP):
        warnings.append("the MTP head's attention layer is not calibrated (engines use 1.0 for it)")
    if ckpt.quantization_config and ckpt.quantization_config.get("quant_method") == "awq":
        warnings.append("AWQ configs: engines may ignore kv_cache_scheme (vLLM's AWQ method loads no KV scales)")
    p = KvPlan(
        ckpt,
        out_p,
        conv,
        layers,
        max(layers) + 1,
        names,
        existing,
        rewrite,
        kv_shard,
        work,
        samples,
        seq_len,
        dataset,
        device,
        sp,
        changes,
        warnings,
        opts,
        mm=mm,
    )

    p.calib = plan_calibration(ckpt, dataset, samples, seq_len)  # refused here if the data is too small

    p.memory = need(sp, device=device, ranks=planned_ranks())
    if p.memory.warning():
        p.warnings.append(p.memory.warning())
    p.output = output_plan(p)
    p.output.summary = p.to_json()
    p.output.summary["memory"].pop("need")  # this machine's free memory: the run's report, not the artifact's record
    return p
