"""calibrate-kv: writing the calibrated checkpoint through the output transaction."""


from __future__ import annotations

import json
import os
import shutil
import struct

from qtool.io.output import MANIFEST_NAME, OutputDir, made_by_qtool
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import load_json, write_json
from qtool.io.quant_config import HfQuantSchema, hf_quant_schema
from qtool.io.writer import FileRange, InlineBytes, OutTensor, index_json, write_shard

from qtool.ops.calibrate_kv.plan import CT_KV_SCHEME, MODELOPT_KV_SCHEME, Convention, KvPlan, kv_only_quantization_config
from qtool.ops.calibrate_kv.calibrate import LayerStat


# ---- write -----------------------------------------------------------------------------------------


def _f32(x: float) -> bytes:
    return struct.pack("<f", x)


def _kv_tensors(p: KvPlan, stats: dict[int, LayerStat]) -> list[OutTensor]:
    out = []
    for i in p.layers:
        kn, vn = p.names[i]
        out.append(OutTensor(kn, "F32", (), InlineBytes(_f32(stats[i].k_scale))))
        out.append(OutTensor(vn, "F32", (), InlineBytes(_f32(stats[i].v_scale))))
    return sorted(out, key=lambda t: t.name)


def _patched_configs(p: KvPlan) -> list[tuple[str, dict, object]]:
    ckpt = p.ckpt
    res = []
    cfg = json.loads(json.dumps(ckpt.config))
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        qc["kv_cache_scheme"] = dict(MODELOPT_KV_SCHEME if p.convention is Convention.MODELOPT else CT_KV_SCHEME)
        res.append((CONFIG_NAME, cfg, ckpt.config_style))
    elif not ckpt.hf_quant_config:
        cfg["quantization_config"] = kv_only_quantization_config()
        res.append((CONFIG_NAME, cfg, ckpt.config_style))
    if ckpt.hf_quant_config:
        hq = json.loads(json.dumps(ckpt.hf_quant_config))
        body = hq["quantization"] if hf_quant_schema(hq) is HfQuantSchema.MODELOPT_NATIVE else hq
        body["kv_cache_quant_algo"] = "FP8"
        res.append((HF_QUANT_CONFIG_NAME, hq, ckpt.hf_quant_style))
    return res


def _stripped_shard(ckpt: Checkpoint, shard: str, remove: set[str]) -> list[OutTensor]:
    header = ckpt.headers[shard]
    out = []
    for name, info in sorted(header.tensors.items(), key=lambda kv: kv[1].start):
        if name in remove:
            continue
        out.append(OutTensor(name, info.dtype, tuple(info.shape), FileRange(info.file, info.start, info.start + info.nbytes)))
    return out


def write_output(p: KvPlan, stats: dict[int, LayerStat], tx: OutputDir, command: str | None = None,
                 hasher=None) -> dict:
    """Write the calibrated checkpoint into the transaction's partial directory and commit it. -o: the
    source's unchanged files are placed there (links); --in-place: the partial directory already holds
    links of every file (InPlaceDir), and the changed ones replace them there."""
    ckpt = p.ckpt
    dest = tx.partial
    remove = set(p.remove)
    new_tensors = _kv_tensors(p, stats)
    weight_map = {n: ckpt.shard_of(n) for n in ckpt.tensors if n not in remove}
    rewritten = sorted(p.rewrite_shards)  # shards that keep their name, minus the replaced scales
    for t in new_tensors:
        weight_map[t.name] = p.kv_shard
    dropped = sorted(s for s in ckpt.headers if s not in set(weight_map.values()))
    total = sum(i.nbytes for n, i in ckpt.tensors.items() if n not in remove) + sum(t.nbytes for t in new_tensors)
    index = dict(ckpt.index or {})
    index.update(index_json(weight_map, total))
    index["metadata"] = {**(ckpt.index or {}).get("metadata", {}), "total_size": total}
    index_style = load_json(ckpt.root / INDEX_NAME)[1] if ckpt.index is not None else None
    configs = _patched_configs(p)
    patched = {c[0] for c in configs} | {INDEX_NAME}
    files = {"new_shard": p.kv_shard, "rewritten_shards": rewritten, "configs": [c[0] for c in configs]}
    changed = set(dropped) | set(rewritten) | {p.kv_shard} | patched
    links: set[str] = set()
    placed: list[str] = []
    if tx.in_place:
        for s in dropped:
            if os.path.lexists(dest / s):
                os.unlink(dest / s)
    else:
        for entry in sorted(ckpt.root.iterdir()):
            if entry.is_file() and entry.name not in changed and entry.name != MANIFEST_NAME:
                links.add(tx.placer.place(entry, dest / entry.name))
                placed.append(entry.name)
    for s in rewritten:
        write_shard(dest / s, _stripped_shard(ckpt, s, remove), ckpt.headers[s].metadata or None,
                    mode=tx.file_mode)
    write_shard(dest / p.kv_shard, new_tensors, {"format": "pt"}, mode=tx.file_mode)
    for name, obj, style in configs:
        write_json(dest / name, obj, style)
    write_json(dest / INDEX_NAME, index, index_style)
    shutil.rmtree(p.work_dir, ignore_errors=True)
    _write_manifest(p, tx, command, files, hasher, placed)
    tx.commit()
    files["output"] = str(tx.out)
    if tx.in_place:
        files["removed_shards"] = [s for s in dropped if s != p.kv_shard]
    else:
        files["shards_reused_by"] = sorted(links) or ["none"]
    return files


def _write_manifest(p: KvPlan, tx: OutputDir, command: str | None, files: dict, hasher=None,
                    placed: list[str] = ()) -> None:
    from qtool.io.manifest import carried_files, placed_digests, previous_head, source_entry, write_manifest
    from qtool.io.output import output_files

    hasher = hasher or start_input_hashes(p, tx, resume=False)
    digests = hasher.results()
    extra = {"kv_cache": {"convention": p.convention.value, "layers": p.layers, "scale_tensors": files}}
    if tx.in_place:
        if previous_head(p.ckpt.root):
            extra["previous"] = previous_head(p.ckpt.root)
        changed = {p.kv_shard, INDEX_NAME, *p.rewrite_shards, *files["configs"]}
        out_files = carried_files(tx.partial, p.ckpt.root, changed)
    else:
        out_files = output_files(tx.partial, placed_digests(p.ckpt.root, placed, digests))
    write_manifest(tx.partial / MANIFEST_NAME, kind="calibrate-kv", command=command,
                   sources={"checkpoint": source_entry(p.ckpt.root, digests)},
                   summary=p.to_json(), checks={}, files=out_files, extra=extra,
                   created=not tx.in_place or made_by_qtool(p.ckpt.root))


def start_input_hashes(p: KvPlan, tx: OutputDir, *, resume: bool):
    """The inputs' sha256 in background threads while the layers run (qtool.io.manifest.InputHasher),
    recorded in the partial output so that a resumed run notices an input edited in between."""
    from qtool.io.manifest import InputHasher

    hasher = InputHasher(trust_cache=not resume, record=tx.input_digests)
    for f in sorted({h.path for h in p.ckpt.headers.values()}):
        hasher.submit(f)
    return hasher
