"""`qtool convert`: lossless conversion between the two NVFP4 checkpoint flavours.

ModelOpt <-> compressed-tensors (formats doc sections 3-4; compressed-tensors' own converter
compressed_tensors/entrypoints/convert/converters/modelopt_nvfp4.py does the same rename + reciprocal):
  weight            <-> weight_packed          (same bytes)
  weight_scale      <-> weight_scale           (same bytes)
  weight_scale_2 [] <-> weight_global_scale [1]  = 1 / x  (float32)
  input_scale []    <-> input_global_scale [1]   = 1 / x
  self_attn.k_proj.k_scale / v_proj.v_scale <-> self_attn.k_scale / v_scale   (same value)
  config.json quantization_config (+ hf_quant_config.json for ModelOpt) rewritten; ignore lists from
  qtool.engines.decide.ignore_patterns_for on the output's tensors.
Shards holding none of the renamed tensors are hardlinked (copied across filesystems); the others are
rewritten by byte-range copies, only the global scales are new bytes.

Round trip: float32 1/(1/x) != x for ~13% of values, so the conversion records the original scalars
(float32 bits) and the original quantization configs in `qtool-convert.json`. Converting back restores
them (only where 1/original still equals the stored value, i.e. the tensor was not changed since), so
ModelOpt -> CT -> ModelOpt (and CT -> ModelOpt -> CT) is bit-identical in every tensor and config. Engines
ignore the extra file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from qtool.arch.model_map import Format, build_map
from qtool.arch.qwen35 import Group
from qtool.errors import PlanError, UsageError
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.formats.naming import NVFP4_NAMINGS, Flavour, QuantFormat
from qtool.io.jsonio import atomic_write_text, load_json, write_json
from qtool.io.files import copy_file
from qtool.io.identity import input_identity, Journal
from qtool.io.output import MANIFEST_NAME, check_no_overlap, output_files, OutputDir
from qtool.ops.contract import Report
from qtool.io.writer import FileRange, InlineBytes, OutTensor, index_json, write_shard

SIDECAR = "qtool-convert.json"
JOURNAL_NAME = ".qtool-journal.jsonl"


# param renames modelopt -> compressed-tensors, from the flavours' one naming table (qtool.formats.naming);
# True = the value is the float32 reciprocal
_MO, _CT = NVFP4_NAMINGS[QuantFormat.NVFP4], NVFP4_NAMINGS[QuantFormat.NVFP4_CT]
_MO_TO_CT = {_MO.weight: (_CT.weight, False), _MO.block_scale: (_CT.block_scale, False),
             _MO.weight_global: (_CT.weight_global, _MO.reciprocal != _CT.reciprocal),
             _MO.input_global: (_CT.input_global, _MO.reciprocal != _CT.reciprocal)}
_CT_TO_MO = {v[0]: (k, v[1]) for k, v in _MO_TO_CT.items()}


def _global_scale(name: str, old: bytes, to: Flavour, orig_bits: int | None) -> bytes:
    """The converted bytes of one global scale (float32), by the exact converter
    qtool.formats.naming.convert_nvfp4; `orig_bits`: the value a previous opposite conversion recorded
    (restored when it still maps to `old`, so round trips are bit-identical)."""
    import torch

    from qtool.formats.naming import convert_nvfp4

    src, dst = ((QuantFormat.NVFP4, QuantFormat.NVFP4_CT) if to is Flavour.COMPRESSED_TENSORS
                else (QuantFormat.NVFP4_CT, QuantFormat.NVFP4))
    param = name.rsplit(".", 1)[1]
    new = (_MO_TO_CT if to is Flavour.COMPRESSED_TENSORS else _CT_TO_MO)[param][0]

    def f32(b: bytes):
        return torch.frombuffer(bytearray(b), dtype=torch.float32)

    originals = {new: f32(struct.pack("<I", orig_bits))} if orig_bits is not None else None
    out = convert_nvfp4({param: f32(old)}, src, dst, originals=originals).tensors[new]
    return out.float().reshape(-1).numpy().tobytes()


def detect(mm) -> Flavour:
    fmts = {m.format for m in mm.modules.values()}
    if Format.NVFP4 in fmts and Format.NVFP4_CT not in fmts:
        return Flavour.MODELOPT
    if Format.NVFP4_CT in fmts and Format.NVFP4 not in fmts:
        return Flavour.COMPRESSED_TENSORS
    raise PlanError("not an NVFP4 checkpoint of one flavour", path=mm.ckpt.root,
                    got=sorted(f.value for f in fmts if f is not None))


def _renames(mm, to: Flavour) -> dict[str, tuple[str, bool]]:
    """source tensor -> (output name, reciprocal?) for every tensor that changes."""
    table = _MO_TO_CT if to is Flavour.COMPRESSED_TENSORS else _CT_TO_MO
    want_fmt = Format.NVFP4 if to is Flavour.COMPRESSED_TENSORS else Format.NVFP4_CT
    out: dict[str, tuple[str, bool]] = {}
    for m in mm.modules.values():
        if m.format is want_fmt:
            for param, info in m.params.items():
                if param in table:
                    new, rec = table[param]
                    out[info.name] = (f"{m.name}.{new}", rec)
    for name, role in mm.roles.items():
        if role.group is not Group.KV_SCALE:
            continue
        attn = role.module.rsplit(".", 1)[0] if role.module.endswith(("k_proj", "v_proj")) else role.module
        if to is Flavour.COMPRESSED_TENSORS and role.module.endswith(("k_proj", "v_proj")):
            out[name] = (f"{attn}.{role.param}", False)
        elif to is Flavour.MODELOPT and not role.module.endswith(("k_proj", "v_proj")):
            proj = "k_proj" if role.param == "k_scale" else "v_proj"
            out[name] = (f"{role.module}.{proj}.{role.param}", False)
    return out


@dataclass(frozen=True)
class ConvertOptions:
    """convert's options: the one place their defaults live (CLI, build steps, library)."""

    checkpoint: Path
    out: Path
    to: Flavour
    force: bool = False
    resume: bool = False
    command: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "to", Flavour(self.to))


def plan(opts: ConvertOptions) -> dict:
    src, out, to = opts.checkpoint, opts.out, Flavour(opts.to)
    ckpt = Checkpoint.open(src, require_config=True)
    mm = build_map(ckpt)
    have = detect(mm)
    if have is to:
        raise UsageError(f"the checkpoint already is {to.value}", path=ckpt.root)
    check_no_overlap(Path(out), [ckpt.root])
    ren = _renames(mm, to)
    touched = sorted({ckpt.shard_of(n) for n in ren})
    return {"ckpt": ckpt, "mm": mm, "from": have, "to": to, "renames": ren, "rewrite": touched,
            "link": sorted(s for s in ckpt.headers if s not in touched), "out": Path(out), "options": opts}


def describe(p: dict) -> dict:
    return {"checkpoint": str(p["ckpt"].root), "output": str(p["out"]), "from": p["from"].value,
            "to": p["to"].value, "renamed_tensors": len(p["renames"]), "rewritten_shards": p["rewrite"],
            "linked_shards": p["link"]}


def execute(p: dict) -> Report:
    """Write the converted checkpoint (through the output transaction)."""
    ckpt, to, opts = p["ckpt"], p["to"], p["options"]
    report = describe(p)
    side = None
    if (ckpt.root / SIDECAR).is_file():
        side, _ = load_json(ckpt.root / SIDECAR, what=SIDECAR)
        if side.get("from") != to.value:
            side = None
    restore = (side or {}).get("scalars", {})
    with OutputDir(p["out"], sources=[ckpt.root], force=opts.force, resume=opts.resume) as tx:
        _write(p, tx, side, restore, report, opts.command)
    return Report(report)


def run(checkpoint: str | Path, *, dry_run: bool = False, **options) -> dict:
    """plan + execute in one call (library convenience): `options` are ConvertOptions fields."""
    p = plan(ConvertOptions(Path(checkpoint), **options))
    return describe(p) if dry_run else execute(p).to_json()


def _write(p: dict, tx: OutputDir, side: dict | None, restore: dict, report: dict, command: str | None) -> None:
    ckpt, to, partial = p["ckpt"], p["to"], tx.partial
    plan_hash = hashlib.sha256(json.dumps([to.value, sorted(p["renames"].items()), p["rewrite"], p["link"]]
                                          ).encode()).hexdigest()
    journal = Journal(partial / JOURNAL_NAME, plan_hash, input_identity(h.path for h in ckpt.headers.values()),
                      tx.resume)
    recorded: dict[str, int] = {}
    ways = set()
    for s in p["link"]:
        if not journal.file_done(partial, s):
            ways.add(tx.placer.place(ckpt.root / s, partial / s))
            journal.record(s, size=(partial / s).stat().st_size)
    weight_map = {}
    for n in ckpt.tensors:
        weight_map[p["renames"].get(n, (n, False))[0]] = ckpt.shard_of(n)
    for s in p["rewrite"]:
        items = []
        for name, info in sorted(ckpt.headers[s].tensors.items(), key=lambda kv: kv[1].start):
            new, rec = p["renames"].get(name, (name, False))
            shape = tuple(info.shape)
            if new != name and info.dtype == "F32" and len(shape) <= 1 and info.nbytes == 4:
                # scalar: [] in ModelOpt, [1] in compressed-tensors
                shape = (1,) if to is Flavour.COMPRESSED_TENSORS and rec else (() if rec else shape)
            if rec:
                with open(info.file, "rb") as f:
                    f.seek(info.start)
                    old = f.read(4)
                data = _global_scale(name, old, to, restore.get(new))
                recorded[name] = struct.unpack("<I", old)[0]
                items.append(OutTensor(new, info.dtype, shape, InlineBytes(data)))
            else:
                items.append(OutTensor(new, info.dtype, shape, FileRange(info.file, info.start, info.end)))
        if not journal.file_done(partial, s):
            size = write_shard(partial / s, items, ckpt.headers[s].metadata or None, mode=tx.file_mode)
            journal.record(s, size=size)
    total = sum(i.nbytes for i in ckpt.tensors.values())
    index_style = load_json(ckpt.root / INDEX_NAME)[1] if (ckpt.root / INDEX_NAME).exists() else None
    index = index_json(weight_map, total)
    if isinstance((ckpt.index or {}).get("metadata"), dict):
        # the same tensor bytes (renames, same-size reciprocals): the source's metadata holds as it is
        # (transformers' total_parameters, its total_size convention)
        index["metadata"] = ckpt.index["metadata"]
    write_json(partial / INDEX_NAME, index, index_style)
    for entry in sorted(ckpt.root.iterdir()):
        if entry.is_file() and entry.suffix != ".safetensors" and entry.name not in (
                INDEX_NAME, CONFIG_NAME, HF_QUANT_CONFIG_NAME, SIDECAR, MANIFEST_NAME):
            copy_file(entry, partial / entry.name, tx.file_mode)
    cfg, style = load_json(ckpt.root / CONFIG_NAME, what="config.json")
    orig_qc = cfg.get("quantization_config")
    orig_hq = ckpt.hf_quant_config
    if side is not None:
        cfg["quantization_config"] = side["quantization_config"]
        hq = side.get("hf_quant_config")
    else:
        from qtool.io.manifest import library_versions
        from qtool.ops.quantize.configs import quant_configs
        from qtool.recipes import OutFormat, Scheme

        cfg.pop("quantization_config", None)
        write_json(partial / CONFIG_NAME, cfg, style)
        mm_out = build_map(Checkpoint.open(partial, require_config=True))
        versions = library_versions()
        from qtool import __version__

        versions["qtool"] = __version__
        fmt = OutFormat.MODELOPT if to is Flavour.MODELOPT else OutFormat.COMPRESSED_TENSORS
        qc, hq = quant_configs(mm_out, Scheme.NVFP4, fmt, bool(mm_out.kv.layers), 16, versions)
        cfg["quantization_config"] = qc
        hq_path = ckpt.root / HF_QUANT_CONFIG_NAME
        write_json(partial / SIDECAR, {"from": p["from"].value, "quantization_config": orig_qc,
                                       "hf_quant_config": orig_hq, "scalars": {
                                           n: v for n, v in recorded.items()},
                                       # the file's own text, so that converting back restores its bytes
                                       "hf_quant_config_text": hq_path.read_text() if hq_path.is_file() else None})
    write_json(partial / CONFIG_NAME, cfg, style)
    hq_text = (side or {}).get("hf_quant_config_text")
    if hq is not None and isinstance(hq_text, str):
        atomic_write_text(partial / HF_QUANT_CONFIG_NAME, hq_text)
    elif hq is not None:
        write_json(partial / HF_QUANT_CONFIG_NAME, hq, ckpt.hf_quant_style)
    from qtool.io.quant_config import summarize
    from qtool.ops.inspect import find_problems

    c2 = Checkpoint.open(partial, require_config=True)
    problems = [x.to_json() for x in find_problems(build_map(c2), summarize(c2.config, c2.hf_quant_config))]
    report["problems"] = problems
    report["shards_reused_by"] = sorted(ways)
    from qtool.io.manifest import InputHasher, placed_digests, source_entry, write_manifest

    hasher = InputHasher(trust_cache=not tx.resume, record=tx.input_digests)
    for f in sorted({h.path for h in ckpt.headers.values()}):
        hasher.submit(f)
    os.unlink(partial / JOURNAL_NAME)
    digests = hasher.results()
    write_manifest(partial / MANIFEST_NAME, kind="convert", command=command,
                   sources={"checkpoint": source_entry(ckpt.root, digests)},
                   summary={k: report[k] for k in ("from", "to", "renamed_tensors", "rewritten_shards")},
                   checks={"inspect_problems": problems},
                   files=output_files(partial, placed_digests(ckpt.root, p["link"], digests)))
    tx.commit()
