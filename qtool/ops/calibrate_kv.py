"""`qtool calibrate-kv`: per-tensor FP8 E4M3 KV-cache scales for every full-attention layer.

k_scale = amax(K) / 448, v_scale = amax(V) / 448 over all calibration tokens, where K and V are what an
engine writes into its KV cache: K after k_proj, k_norm and the (partial, mrope) rotary embedding, V
after v_proj. They are captured at the attention kernel's inputs (qtool.stream.layer_stream.attention_tap:
the tensors transformers' Qwen3_5MoeAttention passes to its attention function, after
apply_rotary_pos_emb), during a layer-streamed forward of the dequantized model. GDN layers have no
KV cache and get no scales; the MTP head's attention layer is not calibrated (it needs the MTP forward).

Output in the checkpoint's own convention (formats doc sections 3 and 4):
  ModelOpt              `...self_attn.k_proj.k_scale`, `...self_attn.v_proj.v_scale`
  compressed-tensors    `...self_attn.k_scale`, `...self_attn.v_scale`   (also BF16, FP8 and AWQ models)
float32 scalars in ONE new shard added to the index (other shards reused unchanged), plus
`kv_cache_scheme` in config.json's quantization_config and `kv_cache_quant_algo: FP8` in
hf_quant_config.json. A model with neither config gets llm-compressor's KV-cache-only
quantization_config (formats doc section 4).

Plan -> validate -> execute: `plan()` reads headers and configs only; `calibrate()` runs the forward
(resumable: a journal plus the hidden states after the last finished layer live in the work directory);
`write_output()` writes `-o OUT` through `OUT.partial/` or, in place, new shard + configs + index (last),
each by temp file + rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.qwen35 import Group, layer_prefix
from qtool.formats.naming import Flavour
from qtool.errors import PlanError, UsageError
from qtool.io.identity import input_identity
from qtool.io.in_place import InPlaceDir
from qtool.io.output import MANIFEST_NAME, check_no_overlap, OutputDir, partial_path
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import load_json, write_json
from qtool.io.quant_config import HfQuantSchema, hf_quant_schema
from qtool.ops.contract import Report
from qtool.io.writer import FileRange, InlineBytes, OutTensor, index_json, write_shard

OUTLIER_RATIO = 10.0
KV_SHARD = "model-kv-scales.safetensors"
JOURNAL = "journal.json"


# KV-scale naming: modelopt self_attn.k_proj.k_scale (modelopt/torch/export/unified_export_hf.py),
# compressed-tensors self_attn.k_scale (compressed_tensors kv_cache): the one flavour enum
Convention = Flavour


# config.json quantization_config.kv_cache_scheme per convention.
# ModelOpt: modelopt/torch/export/convert_hf_config.py (kv_cache_quant_algo FP8 -> this dict).
MODELOPT_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
# compressed-tensors: QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
# symmetric=True).model_dump() with compressed-tensors 0.19, as llm-compressor 0.14 writes it.
CT_KV_SCHEME = {
    "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
    "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None, "zp_dtype": None,
    "observer": "minmax", "observer_kwargs": {},
}


def kv_only_quantization_config() -> dict:
    """What llm-compressor 0.14 writes for KV-cache-only quantization of a BF16 model (formats doc s.4)."""
    return {
        "config_groups": {},
        "format": "dense",
        "ignore": ["re:^mtp.*"],
        "kv_cache_scheme": dict(CT_KV_SCHEME),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


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
    options: "CalibrateKvOptions | None" = None

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
            "calibration": {"dataset": self.dataset, "samples": self.samples, "seq_len": self.seq_len,
                            "tokens": self.samples * self.seq_len},
            "device": self.device,
            "work_dir": str(self.work_dir),
            "memory": {
                **sp.to_json(),
                "peak_ram_bytes_estimate": sp.peak_bytes(hidden_in_ram=False),
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


def plan(opts: CalibrateKvOptions) -> KvPlan:
    from qtool.stream.layer_stream import LayerStreamer

    out, samples, seq_len, dataset, device = opts.out, opts.samples, opts.seq_len, opts.dataset, opts.device
    replace_scales, dtype = opts.replace_scales, opts.dtype
    ckpt = Checkpoint.open(opts.checkpoint, require_config=True)
    streamer = LayerStreamer(ckpt, device=device, dtype=dtype)
    mm = streamer.mm
    layers = list(mm.full_attention)
    if not layers:
        raise PlanError("the model has no full-attention layers (text_config.layer_types)", path=ckpt.root)
    conv = _convention(ckpt, mm)
    names = {i: scale_names(i, mm.naming, conv) for i in layers}
    existing = sorted(n for n, r in mm.roles.items() if r.group is Group.KV_SCALE)
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
    # the hidden states and the journal live in the transaction's partial directory (-o and --in-place)
    work = partial_path(out_p if out_p is not None else ckpt.root) / ".calibrate-kv"
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
    if any(r.group is Group.MTP for r in mm.roles.values()):
        warnings.append("the MTP head's attention layer is not calibrated (engines use 1.0 for it)")
    if ckpt.quantization_config and ckpt.quantization_config.get("quant_method") == "awq":
        warnings.append("AWQ configs: engines may ignore kv_cache_scheme (vLLM's AWQ method loads no KV scales)")
    return KvPlan(
        ckpt, out_p, conv, layers, max(layers) + 1, names, existing, rewrite, kv_shard, work,
        samples, seq_len, dataset, device, sp, changes, warnings, opts,
    )


# ---- calibrate -------------------------------------------------------------------------------------


@dataclass
class LayerStat:
    layer: int
    k_amax: float
    v_amax: float
    tokens: int

    @property
    def k_scale(self) -> float:
        return _scale(self.k_amax)

    @property
    def v_scale(self) -> float:
        return _scale(self.v_amax)

    def to_json(self) -> dict:
        return {"layer": self.layer, "k_amax": self.k_amax, "v_amax": self.v_amax,
                "k_scale": self.k_scale, "v_scale": self.v_scale, "tokens": self.tokens}


def _scale(amax: float) -> float:
    """float32(amax) / 448 in float32, as ModelOpt computes it (qtool.formats.fp8.kv_scale_from_amax); a
    zero amax gives 1.0 (no information)."""
    from qtool.formats.fp8 import kv_scale_from_amax

    return 1.0 if amax <= 0 else float(kv_scale_from_amax(amax))


class _KvHooks:
    def __init__(self, layers, on_done):
        self.layers = set(layers)
        self.stats: dict[int, LayerStat] = {}
        self.on_done = on_done

    def before_layer(self, idx, layer):
        from qtool.stream.layer_stream import attention_tap, kv_amax_tap

        if idx not in self.layers:
            return
        self.stats[idx] = LayerStat(idx, 0.0, 0.0, 0)
        attention_tap(layer, kv_amax_tap(self.stats[idx]))

    def after_layer(self, idx, layer):
        from qtool.stream.layer_stream import attention_tap

        attention_tap(layer, None)
        self.on_done(idx)


def _journal_key(p: KvPlan, digest: str, dtype: str) -> str:
    h = hashlib.sha256()
    for n in sorted(p.ckpt.tensors):
        i = p.ckpt.tensors[n]
        h.update(f"{n}|{i.dtype}|{list(i.shape)}|{os.path.getsize(i.file)}\n".encode())
    h.update(json.dumps(p.ckpt.text_config, sort_keys=True).encode())
    h.update(f"{digest}|{dtype}|{p.samples}|{p.seq_len}".encode())
    # what the forward reads: a same-size edit of a shard with its mtime put back changes the key
    h.update(json.dumps(input_identity(h_.path for h_ in p.ckpt.headers.values())).encode())
    return h.hexdigest()[:32]


def calibrate(
    p: KvPlan,
    ids,
    *,
    resume: bool = False,
    hidden: str = "disk",
    dtype: str | None = None,
    progress=None,
) -> tuple[dict[int, LayerStat], dict]:
    """Run the layer-streamed forward on token windows `ids` [N, L]; returns per-layer stats and timing.
    hidden="disk" keeps the hidden states in the work dir (resumable), "memory" in RAM."""
    from qtool.stream.calib_data import token_digest
    from qtool.stream.layer_stream import DiskStore, LayerStreamer, MemoryStore

    streamer = LayerStreamer(p.ckpt, device=p.device, dtype=dtype)
    n, seq = int(ids.shape[0]), int(ids.shape[1])
    shape = (n, seq, streamer.hidden_size)
    key = _journal_key(p, token_digest(ids), streamer.dtype_name)
    p.work_dir.mkdir(parents=True, exist_ok=True)
    jpath = p.work_dir / JOURNAL
    journal = None
    if resume and jpath.exists():
        journal, _ = load_json(jpath, what="calibrate-kv journal")
        if journal.get("key") != key:
            raise PlanError(
                "--resume: the journal was written for other inputs (checkpoint, data or settings)",
                path=jpath,
                hint="run again without --resume to start over",
            )
    start = 0
    stats: dict[int, LayerStat] = {}
    if journal:
        start = int(journal["next_layer"])
        for s in journal["stats"]:
            stats[s["layer"]] = LayerStat(s["layer"], s["k_amax"], s["v_amax"], s["tokens"])
    if hidden == "disk":
        store = DiskStore(p.work_dir, shape, streamer.dtype, current=(journal or {}).get("current", "a"))
    else:
        if start:
            raise PlanError("--resume needs the hidden states on disk")
        store = MemoryStore.empty(shape, streamer.dtype)
    batch = streamer.batch_windows(seq)
    t0 = time.perf_counter()

    def save(next_layer: int):
        if hidden != "disk":
            return
        write_json(jpath, {"key": key, "next_layer": next_layer, "current": store.current,
                           "stats": [s.to_json() for s in sorted(hooks.stats.values(), key=lambda s: s.layer)]})

    hooks = _KvHooks(p.layers, lambda idx: save(idx + 1))
    hooks.stats.update(stats)
    if start == 0:
        streamer.embed_into(ids, store, batch)
        save(0)
    streamer.run(store, seq, start=start, stop=p.run_layers, hooks=hooks, batch=batch, progress=progress)
    elapsed = time.perf_counter() - t0
    layers_run = p.run_layers - start
    timing = {"seconds": elapsed, "layers_run": layers_run, "resumed_from_layer": start,
              "tokens_per_s": (n * seq * layers_run / p.run_layers) / elapsed if elapsed > 0 else None}
    return {i: hooks.stats[i] for i in p.layers}, timing


def outlier_warnings(stats: dict[int, LayerStat]) -> list[str]:
    out = []
    for what in ("k", "v"):
        vals = {i: getattr(s, f"{what}_scale") for i, s in stats.items()}
        if len(vals) < 3:
            continue
        med = statistics.median(vals.values())
        for i, v in vals.items():
            if med > 0 and (v > OUTLIER_RATIO * med or v < med / OUTLIER_RATIO):
                out.append(f"layer {i}: {what}_scale {v:.4g} is {v / med:.3g}x the median {med:.4g}")
    for i, s in stats.items():
        if s.k_amax <= 0 or s.v_amax <= 0 or s.tokens == 0:
            out.append(f"layer {i}: no K/V seen (amax 0); scale set to 1.0")
    return out


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
    if tx.in_place:
        for s in dropped:
            if os.path.lexists(dest / s):
                os.unlink(dest / s)
    else:
        for entry in sorted(ckpt.root.iterdir()):
            if entry.is_file() and entry.name not in changed and entry.name != MANIFEST_NAME:
                links.add(tx.placer.place(entry, dest / entry.name))
    for s in rewritten:
        write_shard(dest / s, _stripped_shard(ckpt, s, remove), ckpt.headers[s].metadata or None,
                    mode=tx.file_mode)
    write_shard(dest / p.kv_shard, new_tensors, {"format": "pt"}, mode=tx.file_mode)
    for name, obj, style in configs:
        write_json(dest / name, obj, style)
    write_json(dest / INDEX_NAME, index, index_style)
    shutil.rmtree(p.work_dir, ignore_errors=True)
    _write_manifest(p, tx, command, files, hasher)
    tx.commit()
    files["output"] = str(tx.out)
    if tx.in_place:
        files["removed_shards"] = [s for s in dropped if s != p.kv_shard]
    else:
        files["shards_reused_by"] = sorted(links) or ["none"]
    return files


def _write_manifest(p: KvPlan, tx: OutputDir, command: str | None, files: dict, hasher=None) -> None:
    from qtool.io.output import output_files
    from qtool.io.manifest import carried_files, previous_head, source_entry, write_manifest

    hasher = hasher or start_input_hashes(p, tx, resume=False)
    extra = {"kv_cache": {"convention": p.convention.value, "layers": p.layers, "scale_tensors": files}}
    if tx.in_place:
        if previous_head(p.ckpt.root):
            extra["previous"] = previous_head(p.ckpt.root)
        changed = {p.kv_shard, INDEX_NAME, *p.rewrite_shards, *files["configs"]}
        out_files = carried_files(tx.partial, p.ckpt.root, changed)
    else:
        out_files = output_files(tx.partial)
    write_manifest(tx.partial / MANIFEST_NAME, kind="calibrate-kv", command=command,
                   sources={"checkpoint": source_entry(p.ckpt.root, hasher.results())},
                   summary=p.to_json(), checks={}, files=out_files, extra=extra)


def start_input_hashes(p: KvPlan, tx: OutputDir, *, resume: bool):
    """The inputs' sha256 in background threads while the layers run (qtool.io.manifest.InputHasher),
    recorded in the partial output so that a resumed run notices an input edited in between."""
    from qtool.io.manifest import InputHasher

    hasher = InputHasher(trust_cache=not resume, record=tx.input_digests)
    for f in sorted({h.path for h in p.ckpt.headers.values()}):
        hasher.submit(f)
    return hasher


# ---- the whole operation ---------------------------------------------------------------------------


def execute(p: KvPlan, *, progress=None) -> Report:
    """Calibrate and write (through the output transaction: -o OUT or the in-place swap)."""
    opts = p.options
    report = {"plan": p.to_json()}
    if p.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available", hint="use --device cpu")
    from qtool.stream.calib_data import build_calib_set

    calib = build_calib_set(p.ckpt.root, p.dataset, p.samples, p.seq_len)
    vocab = int(p.ckpt.text_config.get("vocab_size", 1 << 62))
    if int(calib.ids.max()) >= vocab:
        raise PlanError("the tokenizer gives ids beyond the model's vocab_size", expected=f"< {vocab}",
                        got=int(calib.ids.max()), hint="the tokenizer does not belong to this checkpoint")
    # the transaction (lock, writability, the --force rules) is taken before the forward pass
    tx = (OutputDir(p.out, sources=[p.ckpt.root], force=opts.force, resume=opts.resume) if p.out is not None
          else InPlaceDir(p.ckpt.root, resume=opts.resume))
    with tx:
        hasher = start_input_hashes(p, tx, resume=opts.resume)
        try:
            stats, timing = calibrate(p, calib.ids, resume=opts.resume, progress=progress)
        except BaseException:
            hasher.close()
            raise
        report["layers"] = [stats[i].to_json() for i in p.layers]
        report["warnings"] = p.warnings + outlier_warnings(stats)
        report["timing"] = timing
        report["calibration"] = {"dataset": p.dataset, "digest": calib.digest, "tokens": calib.tokens,
                                 "available_tokens": calib.available_tokens}
        report["output"] = write_output(p, stats, tx, opts.command, hasher)
    return Report(report)


def run(checkpoint: str | Path, *, dry_run: bool = False, progress=None, **options) -> dict:
    """plan + execute in one call (library convenience): `options` are CalibrateKvOptions fields."""
    p = plan(CalibrateKvOptions(Path(checkpoint), **options))
    return {"plan": p.to_json()} if dry_run else execute(p, progress=progress).to_json()
