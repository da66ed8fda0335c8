"""quantize: the output checkpoint as an output plan (qtool.io.plan), decided before any layer runs.

Each decoder layer's shard is Produced (the layer loop writes it: its quantized experts are computed);
the carried-over tensors (embeddings, lm_head, the MTP head, vision) are Shards of byte ranges, split at
5 GB; configs are made for the output's tensors from the plan's own headers (qtool.io.plan.header_checkpoint),
so `--dry-run` shows them and nothing about them is decided after the layers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qtool import __version__
from qtool.arch.model_map import build_map
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME
from qtool.io.jsonio import load_json
from qtool.io.manifest import library_versions
from qtool.io.output import MANIFEST_NAME, partial_path
from qtool.io.plan import Copy, Index, Json, OutputPlan, Produced, Shard, checkpoint_files, header_checkpoint, promised
from qtool.io.writer import OutTensor, plan_shards
from qtool.ops.quantize import configs
from qtool.recipes import KvCache, Scheme

if TYPE_CHECKING:
    from qtool.ops.quantize.plan import QuantizePlan, Spec

REST_SHARD = "model-rest-{:05d}.safetensors"
REST_SHARD_BYTES = 5 * 10**9
# source files never carried over: regenerated here, or the recipe that made the source
SKIP_FILES = {INDEX_NAME, CONFIG_NAME, HF_QUANT_CONFIG_NAME, "recipe.yaml", MANIFEST_NAME}


def _tensor(spec: Spec) -> OutTensor:
    if spec.source is None:  # computed by the layer loop
        return promised(spec.name, spec.dtype, spec.shape, spec.nbytes)
    return OutTensor(spec.name, spec.dtype, spec.shape, spec.source)


def side_files(root: Path) -> list[Path]:
    """The source's files other than weights and the configs made anew, in sub-folders too."""

    return [e for rel, e in checkpoint_files(root) if e.suffix != ".safetensors" and rel not in SKIP_FILES]


def input_files(plan: QuantizePlan) -> list[str]:
    """Every source file that contributes bytes: the shards holding any tensor (copied by byte range or
    read dense for calibration and quantization), config.json and the copied side files."""
    shards = {i.file for i in plan.ckpt.tensors.values()}
    return sorted(shards | {str(e) for e in side_files(plan.ckpt.root)} | {str(plan.ckpt.root / CONFIG_NAME)})


def output_plan(plan: QuantizePlan) -> OutputPlan:

    files: list = [Produced(layer_plan.shard, [_tensor(s) for s in layer_plan.specs]) for layer_plan in plan.layers]
    by_name = {s.name: s for s in plan.rest}
    groups = plan_shards([(s.name, s.nbytes) for s in plan.rest], REST_SHARD_BYTES)
    files += [Shard(REST_SHARD.format(k), [_tensor(by_name[n]) for n in names]) for k, names in enumerate(groups)]
    weight_map = {t.name: e.name for e in files for t in e.tensors}
    total = sum(t.nbytes for e in files for t in e.tensors)
    side = side_files(plan.ckpt.root)
    files += [Copy(e.relative_to(plan.ckpt.root).as_posix(), str(e)) for e in side]
    cfg, style = load_json(plan.ckpt.root / CONFIG_NAME, what="config.json")
    cfg.pop("quantization_config", None)
    out = OutputPlan("quantize", files, sources={"bf16": plan.ckpt.root}, inputs=input_files(plan))
    # every tensor where OUT.partial will hold it: the output's checks read its scale values back there
    model_map = plan.output_map = build_map(
        header_checkpoint(partial_path(plan.out), out, cfg, as_written=True), read_values=False
    )
    versions = {**library_versions(), "qtool": __version__}
    qc, hq = configs.quant_configs(
        model_map,
        plan.recipe.quantized_scheme,
        plan.format,
        plan.recipe.kv_cache is KvCache.FP8,
        plan.int4_group,
        versions,
        {"gate_proj": plan.hidden, "up_proj": plan.hidden, "down_proj": plan.inter},
        mixed=Scheme.FP8 in plan.recipe.schemes,
    )
    cfg["quantization_config"] = qc
    files.append(Json(CONFIG_NAME, cfg, style))
    if hq is not None:
        files.append(Json(HF_QUANT_CONFIG_NAME, hq))
    files.append(Index(INDEX_NAME, weight_map, {"total_size": total}))
    out.summary = {"shards": len(plan.layers) + len(groups), "bytes": total}
    out.extra = {
        "recipe": plan.recipe.to_json(),
        "backend": plan.backend.value,
        "format": plan.format.value,
        "layer_shards": {
            layer_plan.shard: {
                "layer": layer_plan.index,
                "routed_experts": layer_plan.scheme.value,
                **({"fp8": list(layer_plan.fp8)} if layer_plan.fp8 else {}),
            }
            for layer_plan in plan.layers
        },
        "carried_over": {"tensors": len(plan.rest), "shards": [REST_SHARD.format(k) for k in range(len(groups))]},
        "side_files": [e.relative_to(plan.ckpt.root).as_posix() for e in side],
    }
    return out
