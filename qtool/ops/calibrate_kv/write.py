"""calibrate-kv: the calibrated checkpoint as an output plan (qtool.io.plan), decided before calibration;
the KV scales are its only values computed later (Pending), given to the executor once calibrated."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.arch.model_map import build_map
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import file_style
from qtool.io.plan import Json, OutputPlan, Pending, Remove, Shard, unchanged_files
from qtool.io.quant_config import HfQuantSchema, hf_quant_schema
from qtool.io.writer import FileRange, OutTensor, index_json
from qtool.ops.calibrate_kv.scheme import CT_KV_SCHEME, MODELOPT_KV_SCHEME, Convention, kv_only_quantization_config
from qtool.stream.dequant import layer_tensors

if TYPE_CHECKING:  # the plan builds its output plan here; the stats are only read
    from qtool.ops.calibrate_kv.calibrate import LayerStat
    from qtool.ops.calibrate_kv.plan import KvPlan


def scale_values(p: KvPlan, stats: dict[int, LayerStat]) -> dict[str, bytes]:
    """The Pending values of the plan's KV-scale tensors: float32 scalars."""
    out = {}
    for i in p.layers:
        kn, vn = p.names[i]
        out[kn] = struct.pack("<f", stats[i].k_scale)
        out[vn] = struct.pack("<f", stats[i].v_scale)
    return out


def _kv_tensors(p: KvPlan) -> list[OutTensor]:
    names = sorted(n for i in p.layers for n in p.names[i])
    return [OutTensor(n, "F32", (), Pending(n, 4)) for n in names]


def _patched_configs(p: KvPlan) -> list[Json]:
    ckpt = p.ckpt
    res = []
    cfg = json.loads(json.dumps(ckpt.config))
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        qc["kv_cache_scheme"] = dict(MODELOPT_KV_SCHEME if p.convention is Convention.MODELOPT else CT_KV_SCHEME)
        res.append(Json(CONFIG_NAME, cfg, ckpt.config_style))
    elif not ckpt.hf_quant_config:
        cfg["quantization_config"] = kv_only_quantization_config()
        res.append(Json(CONFIG_NAME, cfg, ckpt.config_style))
    if ckpt.hf_quant_config:
        hq = json.loads(json.dumps(ckpt.hf_quant_config))
        body = hq["quantization"] if hf_quant_schema(hq) is HfQuantSchema.MODELOPT_NATIVE else hq
        body["kv_cache_quant_algo"] = "FP8"
        res.append(Json(HF_QUANT_CONFIG_NAME, hq, ckpt.hf_quant_style))
    return res


@dataclass(frozen=True)
class Span:
    """Adjacent tensors of a rewritten shard that the layer pass reads with one of its layers: the input's
    bytes `source`, handed from that read to the shard's writer (not read from the input again)."""

    shard: str
    layer: int
    source: FileRange
    tensors: tuple[tuple[str, int, int], ...]  # (name, offset in the span, bytes), in the shard's order


def fed_spans(p: KvPlan) -> list[Span]:
    """The rewritten shards' tensors the layer pass reads (layers 0..run_layers-1), as spans of adjacent
    bytes within one layer's read. The shards' other tensors (another part of the model, a layer past the
    last one the pass runs) are copied from the input."""
    mm = p.mm if p.mm is not None else build_map(p.ckpt)
    read: dict[str, tuple[int, str]] = {}  # tensor -> (layer, file) of what the pass reads
    for i in range(p.run_layers):
        read.update((info.name, (i, info.file)) for info in layer_tensors(mm, i))
    remove = set(p.remove)
    spans: list[Span] = []
    for shard in sorted(p.rewrite_shards):
        run: list[OutTensor] = []
        layer = -1
        for t in _stripped_shard(p.ckpt, shard, remove):
            where = read.get(t.name)
            adjacent = bool(run) and where == (layer, t.source.file) and run[-1].source.end == t.source.start
            if run and not adjacent:
                spans.append(_span(shard, layer, run))
                run = []
            if where is not None and where[1] == t.source.file:
                run.append(t)
                layer = where[0]
        if run:
            spans.append(_span(shard, layer, run))
    return spans


def _span(shard: str, layer: int, run: list[OutTensor]) -> Span:
    first = run[0].source
    return Span(
        shard,
        layer,
        FileRange(first.file, first.start, run[-1].source.end),
        tuple((t.name, t.source.start - first.start, t.source.nbytes) for t in run),
    )


def _stripped_shard(ckpt: Checkpoint, shard: str, remove: set[str]) -> list[OutTensor]:
    out = [
        OutTensor(i.name, i.dtype, tuple(i.shape), FileRange(i.file, i.start, i.end))
        for i in ckpt.headers[shard].tensors.values()
        if i.name not in remove
    ]
    return sorted(out, key=lambda t: t.source.start)


def output_plan(p: KvPlan) -> OutputPlan:
    """Every file of the calibrated checkpoint. -o: the source's unchanged files are Links; --in-place: the
    transaction's partial directory already holds links of every file (InPlaceDir), so only the changed
    files and the shards that no longer belong are listed."""
    ckpt = p.ckpt
    remove = set(p.remove)
    new_tensors = _kv_tensors(p)
    weight_map = ckpt.weight_map()
    for n in remove:
        del weight_map[n]
    for t in new_tensors:
        weight_map[t.name] = p.kv_shard
    kept = set(weight_map.values())
    dropped = sorted(s for s in ckpt.headers if s not in kept)
    total = ckpt.total_bytes() - sum(ckpt.tensor_bytes(n) for n in remove) + sum(t.nbytes for t in new_tensors)
    index = dict(ckpt.index or {})
    index.update(index_json(weight_map, total))
    index["metadata"] = {**(ckpt.index or {}).get("metadata", {}), "total_size": total}
    index_style = file_style(ckpt.root / INDEX_NAME, what="safetensors index") if ckpt.index is not None else None
    configs = _patched_configs(p)
    changed = set(dropped) | set(p.rewrite_shards) | {p.kv_shard, INDEX_NAME} | {c.name for c in configs}
    files: list = []
    if p.out is None:
        files += [Remove(s) for s in dropped]
    else:
        files += unchanged_files(ckpt.root, changed)  # every other file, in sub-folders too
    fed = {sp.shard for sp in fed_spans(p)} if p.rewrite_shards else set()
    files += [
        Shard(s, _stripped_shard(ckpt, s, remove), ckpt.headers[s].metadata or None, fed=s in fed)
        for s in sorted(p.rewrite_shards)
    ]
    files.append(Shard(p.kv_shard, new_tensors, {"format": "pt"}))
    files += configs
    files.append(Json(INDEX_NAME, index, index_style))
    scale_files = {
        "new_shard": p.kv_shard,
        "rewritten_shards": sorted(p.rewrite_shards),
        "configs": [c.name for c in configs],
    }
    return OutputPlan(
        "calibrate-kv",
        files,
        sources={"checkpoint": ckpt.root},
        inputs=sorted({h.path for h in ckpt.headers.values()}),
        extra={"kv_cache": {"convention": p.convention.value, "layers": p.layers, "scale_tensors": scale_files}},
    )
