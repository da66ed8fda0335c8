"""`qtool convert`: lossless conversion between the two NVFP4 checkpoint flavours.

ModelOpt <-> compressed-tensors (docs/formats.md §3-4; compressed-tensors' own converter
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

import struct
from dataclasses import dataclass
from pathlib import Path

from qtool import __version__
from qtool.arch.model_map import Format, build_map
from qtool.arch.qwen35 import Group
from qtool.errors import PlanError, UsageError
from qtool.formats.naming import NVFP4_NAMINGS, Flavour, QuantFormat, convert_nvfp4
from qtool.io.apply import OutputJob, write_output
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import file_style, load_json
from qtool.io.manifest import library_versions
from qtool.io.output import MANIFEST_NAME, OutputDir, check_no_overlap
from qtool.io.plan import Copy, Json, Link, OutputPlan, Shard, Text, checkpoint_files, header_checkpoint
from qtool.io.quant_config import summarize
from qtool.io.writer import FileRange, InlineBytes, OutTensor, index_json
from qtool.ops.checks import inspect_check
from qtool.ops.contract import Report
from qtool.ops.inspect import find_problems
from qtool.ops.quantize.configs import quant_configs
from qtool.recipes import OutFormat, Scheme

SIDECAR = "qtool-convert.json"


# param renames modelopt -> compressed-tensors, from the flavours' one naming table (qtool.formats.naming);
# True = the value is the float32 reciprocal
_MO, _CT = NVFP4_NAMINGS[QuantFormat.NVFP4], NVFP4_NAMINGS[QuantFormat.NVFP4_CT]
_MO_TO_CT = {
    _MO.weight: (_CT.weight, False),
    _MO.block_scale: (_CT.block_scale, False),
    _MO.weight_global: (_CT.weight_global, _MO.reciprocal != _CT.reciprocal),
    _MO.input_global: (_CT.input_global, _MO.reciprocal != _CT.reciprocal),
}
_CT_TO_MO = {v[0]: (k, v[1]) for k, v in _MO_TO_CT.items()}


def _global_scale(name: str, old: bytes, to: Flavour, orig_bits: int | None) -> bytes:
    """The converted bytes of one global scale (float32), by the exact converter
    qtool.formats.naming.convert_nvfp4; `orig_bits`: the value a previous opposite conversion recorded
    (restored when it still maps to `old`, so round trips are bit-identical)."""
    import torch

    src, dst = (
        (QuantFormat.NVFP4, QuantFormat.NVFP4_CT)
        if to is Flavour.COMPRESSED_TENSORS
        else (QuantFormat.NVFP4_CT, QuantFormat.NVFP4)
    )
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
    raise PlanError(
        "not an NVFP4 checkpoint of one flavour",
        path=mm.ckpt.root,
        got=sorted(f.value for f in fmts if f is not None),
        hint="convert reads an NVFP4 checkpoint (ModelOpt or compressed-tensors) and writes the other "
        "flavour; `qtool inspect` shows what this one holds (a BF16 checkpoint is quantized with "
        "`qtool quantize`)",
    )


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


@dataclass
class ConvertPlan:
    """convert's decision: the output as data (qtool.io.plan.OutputPlan) and what the report says."""

    options: ConvertOptions
    ckpt: Checkpoint
    have: Flavour
    renames: dict[str, tuple[str, bool]]
    output: OutputPlan

    def to_json(self) -> dict:
        return {
            "checkpoint": str(self.ckpt.root),
            "output": str(self.options.out),
            "from": self.have.value,
            "to": self.options.to.value,
            "renamed_tensors": len(self.renames),
            "rewritten_shards": [e.name for e in self.output.entries(Shard)],
            "linked_shards": [e.name for e in self.output.entries(Link) if e.name.endswith(".safetensors")],
        }


def plan(opts: ConvertOptions) -> ConvertPlan:
    """Read the checkpoint's headers and configs and decide every output file (nothing is written)."""
    src, out, to = opts.checkpoint, Path(opts.out), Flavour(opts.to)
    ckpt = Checkpoint.open(src, require_config=True)
    mm = build_map(ckpt)
    have = detect(mm)
    if have is to:
        other = next(f for f in Flavour if f is not to)
        raise UsageError(
            f"the checkpoint already is {to.value}",
            path=ckpt.root,
            hint=f"nothing to convert: serve it as it is, or give --to {other.value}",
        )
    check_no_overlap(out, [ckpt.root])
    ren = _renames(mm, to)
    side = None
    if (ckpt.root / SIDECAR).is_file():
        side, _ = load_json(ckpt.root / SIDECAR, what=SIDECAR)
        if side.get("from") != to.value:
            side = None
    restore = (side or {}).get("scalars", {})
    touched = {ckpt.shard_of(n) for n in ren}
    files: list = []
    recorded: dict[str, int] = {}
    for s in sorted(ckpt.headers):
        if s in touched:
            files.append(
                Shard(s, _converted_tensors(ckpt, s, ren, to, restore, recorded), ckpt.headers[s].metadata or None)
            )
        else:
            files.append(Link(s, str(ckpt.root / s)))
    for rel, entry in checkpoint_files(ckpt.root):  # the side files, in sub-folders too
        if entry.suffix != ".safetensors" and rel not in (
            INDEX_NAME,
            CONFIG_NAME,
            HF_QUANT_CONFIG_NAME,
            SIDECAR,
            MANIFEST_NAME,
        ):
            files.append(Copy(rel, str(entry)))
    files.append(_index(ckpt, ren))
    output = OutputPlan(
        "convert", files, sources={"checkpoint": ckpt.root}, inputs=sorted({h.path for h in ckpt.headers.values()})
    )
    files += _configs(ckpt, have, to, side, recorded, output, out)
    p = ConvertPlan(opts, ckpt, have, ren, output)
    output.summary = {
        k: v for k, v in p.to_json().items() if k in ("from", "to", "renamed_tensors", "rewritten_shards")
    }
    return p


def _converted_tensors(
    ckpt: Checkpoint, shard: str, ren: dict, to: Flavour, restore: dict, recorded: dict[str, int]
) -> list[OutTensor]:
    """The shard's tensors in file order: renamed ones by name, global scales as their reciprocal (new
    bytes; the original's float32 bits go to `recorded`), every other byte a range of the source."""
    items = []
    for name, info in sorted(ckpt.headers[shard].tensors.items(), key=lambda kv: kv[1].start):
        new, rec = ren.get(name, (name, False))
        shape = tuple(info.shape)
        if new != name and info.dtype == "F32" and len(shape) <= 1 and info.nbytes == 4:
            # scalar: [] in ModelOpt, [1] in compressed-tensors
            shape = (1,) if to is Flavour.COMPRESSED_TENSORS and rec else (() if rec else shape)
        if rec:
            with open(info.file, "rb") as f:
                f.seek(info.start)
                old = f.read(4)
            recorded[name] = struct.unpack("<I", old)[0]
            items.append(OutTensor(new, info.dtype, shape, InlineBytes(_global_scale(name, old, to, restore.get(new)))))
        else:
            items.append(OutTensor(new, info.dtype, shape, FileRange(info.file, info.start, info.end)))
    return items


def _index(ckpt: Checkpoint, ren: dict) -> Json:
    weight_map = {ren.get(n, (n, False))[0]: ckpt.shard_of(n) for n in ckpt.tensors}
    index = index_json(weight_map, sum(i.nbytes for i in ckpt.tensors.values()))
    if isinstance((ckpt.index or {}).get("metadata"), dict):
        # the same tensor bytes (renames, same-size reciprocals): the source's metadata holds as it is
        # (transformers' total_parameters, its total_size convention)
        index["metadata"] = ckpt.index["metadata"]
    style = file_style(ckpt.root / INDEX_NAME, what="safetensors index") if (ckpt.root / INDEX_NAME).exists() else None
    return Json(INDEX_NAME, index, style)


def _configs(
    ckpt: Checkpoint, have: Flavour, to: Flavour, side: dict | None, recorded: dict, output: OutputPlan, out: Path
) -> list:
    """config.json and hf_quant_config.json of the output: the originals a previous conversion recorded in
    its sidecar, else made for the output's tensors (and a sidecar recording what this conversion changed)."""
    cfg, style = load_json(ckpt.root / CONFIG_NAME, what="config.json")
    if side is not None:
        cfg["quantization_config"] = side["quantization_config"]
        files = [Json(CONFIG_NAME, cfg, style)]
        hq, hq_text = side.get("hf_quant_config"), side.get("hf_quant_config_text")
        if hq is not None and isinstance(hq_text, str):
            files.append(Text(HF_QUANT_CONFIG_NAME, hq_text))  # its bytes as they were
        elif hq is not None:
            files.append(Json(HF_QUANT_CONFIG_NAME, hq, ckpt.hf_quant_style))
        return files

    orig_qc = cfg.pop("quantization_config", None)
    mm_out = build_map(header_checkpoint(out, output, cfg), read_values=False)
    versions = {**library_versions(), "qtool": __version__}
    fmt = OutFormat.MODELOPT if to is Flavour.MODELOPT else OutFormat.COMPRESSED_TENSORS
    qc, hq = quant_configs(mm_out, Scheme.NVFP4, fmt, bool(mm_out.kv.layers), 16, versions)
    cfg["quantization_config"] = qc
    hq_path = ckpt.root / HF_QUANT_CONFIG_NAME
    files = [
        Json(CONFIG_NAME, cfg, style),
        Json(
            SIDECAR,
            {
                "from": have.value,
                "quantization_config": orig_qc,
                "hf_quant_config": ckpt.hf_quant_config,
                "scalars": dict(recorded),
                # the file's own text, so that converting back restores its bytes
                "hf_quant_config_text": hq_path.read_text() if hq_path.is_file() else None,
            },
        ),
    ]
    if hq is not None:
        files.append(Json(HF_QUANT_CONFIG_NAME, hq, ckpt.hf_quant_style))
    return files


def describe(p: ConvertPlan) -> dict:
    return p.to_json()


def execute(p: ConvertPlan) -> Report:
    """Write the converted checkpoint (the shared executor, qtool.io.apply, in an output transaction)."""
    opts = p.options
    report = p.to_json()

    def check() -> dict:
        c2 = Checkpoint.open(tx.partial, require_config=True)
        checked = inspect_check(find_problems(build_map(c2), summarize(c2.config, c2.hf_quant_config)))
        report["problems"], report["warnings"] = checked["inspect_problems"], checked.get("inspect_warnings", [])
        del checked["passed"], checked["summary"]  # recorded in the manifest; convert's output check fails nothing
        return checked

    with OutputDir(opts.out, sources=[p.ckpt.root], force=opts.force, resume=opts.resume) as tx:
        applied = write_output(p.output, tx, OutputJob(command=opts.command, check=check))
    report["shards_reused_by"] = sorted(applied.linked)
    return Report(report)


def run(checkpoint: str | Path, *, dry_run: bool = False, **options) -> dict:
    """plan + execute in one call (library convenience): `options` are ConvertOptions fields."""
    p = plan(ConvertOptions(Path(checkpoint), **options))
    return describe(p) if dry_run else execute(p).to_json()
