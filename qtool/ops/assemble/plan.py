"""Plan a hybrid assembly (formats doc section 7) from headers and configs only.

The plan says, for every output shard, whether it is the NVFP4 source's shard unchanged (linked), rebuilt
from byte ranges under its own name, or new; and for every output tensor where its bytes come from. Fused
BF16 routed experts are split into the per-expert layout by byte ranges: in `experts.gate_up_proj`
[E, 2I, H] expert e's gate rows are the contiguous bytes [e*2I*H, e*2I*H + I*H) and its up rows the next
I*H elements; `experts.down_proj` [E, H, I] holds expert e's [H, I] matrix contiguously (row-major).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from array import array
from typing import NamedTuple

from qtool.arch.model_map import QUANTIZED_FORMATS, ModelMap, build_map
from qtool.arch.qwen35 import MTP_PREFIX, Group, Naming, TEXT_PREFIX, engine_module
from qtool.errors import CheckpointError, PlanError, UsageError
from qtool.io.checkpoint import HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.dtypes import DTYPE_BITS, FLOAT_DTYPES
from qtool.io.files import LinkMode
from qtool.io.output import MANIFEST_NAME, check_no_overlap
from qtool.io.quant_config import config_ignore, hf_quant_exclude
from qtool.io.safetensors_header import TensorInfo
from qtool.io.tensor_table import TensorTable
from qtool.io.writer import FileRange, OutTensor, plan_shards

JOURNAL_NAME = ".qtool-journal.jsonl"
NEW_SHARD_TEMPLATE = "model-hybrid-{i:05d}-of-{n:05d}.safetensors"
# Files of a source directory that are never carried over (regenerated, or download bookkeeping).
SKIP_FILES = frozenset({INDEX_NAME, MANIFEST_NAME, JOURNAL_NAME})
SKIP_DIRS = frozenset({".cache", ".git", ".huggingface"})


class MtpMode(str, Enum):
    AUTO = "auto"
    FROM_BF16 = "from-bf16"
    KEEP = "keep"
    DROP = "drop"


class ShardAction(str, Enum):
    LINK = "link"  # the NVFP4 source shard, byte for byte
    REBUILD = "rebuild"  # an NVFP4 source shard that lost or gained tensors, same name
    NEW = "new"  # a shard that holds only additions


class Origin(NamedTuple):  # NamedTuples, not frozen dataclasses: a 397B plan makes ~370k of each
    source: str  # "nvfp4" | "bf16"
    file: str  # absolute path of the source shard
    tensor: str  # tensor name in the source
    start: int  # absolute byte range in `file`
    end: int
    slice: str | None = None  # e.g. "gate rows of expert 3" when unfused


class PlannedTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    origin: Origin

    @property
    def nbytes(self) -> int:
        return self.origin.end - self.origin.start


@dataclass
class PlannedShard:
    """One output shard. Its tensors are the NVFP4 source's `rows` of `table` (carried over whole, in that
    order), then `added` (from the BF16 source, or unfused). Rows instead of PlannedTensors: a 397B plan
    carries ~370k tensors, ~85 MB as objects, 4 bytes each as rows; `tensors` makes them when asked."""

    name: str
    action: ShardAction
    rows: array = field(default_factory=lambda: array("I"))
    added: list[PlannedTensor] = field(default_factory=list)
    source_file: str | None = None  # for LINK/REBUILD: the NVFP4 shard
    metadata: dict[str, str] | None = None
    table: TensorTable | None = None  # the NVFP4 source's tensors (None once released)
    data_bytes: int = 0

    def _carried(self, make) -> list:
        """make(name, file, dtype, shape, start, end) for each carried tensor, in order."""
        if not self.rows:
            return []
        if self.table is None:
            raise RuntimeError(f"the plan's tensors of {self.name} were released")
        return self.table.each(self.rows, make)

    @property
    def tensors(self) -> list[PlannedTensor]:
        return self._carried(lambda name, file, dtype, shape, start, end: PlannedTensor(
            name, dtype, shape, Origin("nvfp4", file, name, start, end))) + self.added

    def names(self) -> list[str]:
        return self._carried(lambda name, *_: name) + [t.name for t in self.added]

    @property
    def num_tensors(self) -> int:
        return len(self.rows) + len(self.added)

    def out_tensors(self) -> list[OutTensor]:
        """The shard's tensors as the writer takes them (made straight from the table's columns: a 397B
        shard has ~7k)."""
        out = self._carried(lambda name, file, dtype, shape, start, end:
                            OutTensor(name, dtype, shape, FileRange(file, start, end)))
        out.extend(OutTensor(a.name, a.dtype, a.shape, FileRange(a.origin.file, a.origin.start, a.origin.end))
                   for a in self.added)
        return out

    def release_tensors(self) -> None:
        """Forget the source table (execute: once the shard's writer has its tensor list)."""
        self.table = None


@dataclass
class HybridOptions:
    nvfp4: Path
    bf16: Path
    out: Path
    bf16_expert_layers: tuple[int, ...] = ()
    mtp: MtpMode = MtpMode.AUTO
    link: LinkMode = LinkMode.AUTO
    max_shard_size: int | None = None  # None: 5% above the NVFP4 source's largest shard, at least 5 GB


def bf16_source_patterns(bf16_expert_layers, mtp: str = "auto") -> list[str]:
    """Tensor-name patterns of everything `assemble hybrid` can take from the BF16 source: every layer's
    shared expert (and its gate), the routed experts of `bf16_expert_layers`, and the MTP head for
    mtp auto/from-bf16. Used to range-fetch just these from a Hub repo instead of ~800 GB."""
    pats = ["*.mlp.shared_expert.*", "*.mlp.shared_expert_gate.*"]
    pats += [f"*.layers.{int(layer)}.mlp.experts.*" for layer in bf16_expert_layers]
    if str(getattr(mtp, "value", mtp)) in ("auto", "from-bf16"):
        pats.append("mtp.*")
    return pats


@dataclass
class HybridPlan:
    options: HybridOptions
    nv: Checkpoint
    bf: Checkpoint
    nv_map: ModelMap | None  # None after release_source_headers
    flavour: str  # "modelopt" | "compressed-tensors"
    shards: list[PlannedShard]
    removed: list[str]  # NVFP4 tensors not in the output
    mtp_action: str  # none | keep | graft | from-bf16 | drop
    bf16_units: list[str]  # HF module names (engine units) that are BF16 because of this assembly
    config: dict | None  # the output config.json
    hf_quant_config: dict | None
    ignore_added: list[str]
    extra_files: list[str]  # non-weight files of the NVFP4 source, relative paths
    warnings: list[str] = field(default_factory=list)
    # memo of shard sizes (a rebuilt shard's size needs its header built: ~7k tensors per 397B shard)
    _sizes: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _summary: dict | None = field(default=None, repr=False, compare=False)

    def release_source_headers(self) -> None:
        """Drop the BF16 source's header metadata and the NVFP4 map, keeping roots, configs and styles;
        the plan's shards and figures stay usable (they keep the NVFP4 tensor table until
        `release_tensors`)."""
        self.summary()  # computed while the sources are still here
        self.nv = dataclasses.replace(self.nv, tensors={}, headers={}, index=None)
        self.bf = dataclasses.replace(self.bf, tensors={}, headers={}, index=None)
        self.nv_map = None

    def release_tensors(self) -> None:
        """Drop the NVFP4 tensor table too (~85 MB for a 397B source): after this only the figures, the
        sizes already computed and the shards' names remain. `execute` calls it once every shard's writer
        has taken its tensor list, before the checks read the output's headers."""
        self.release_source_headers()
        for s in self.shards:
            s.release_tensors()

    # ---- derived figures ------------------------------------------------------------------------
    def bytes_by_action(self) -> dict[str, int]:
        out = {"reused": 0, "rewritten": 0, "new": 0}
        for s in self.shards:
            if s.action is ShardAction.LINK:
                out["reused"] += s.data_bytes
                continue
            new = sum(t.nbytes for t in s.added if t.origin.source != "nvfp4")
            out["new"] += new
            out["rewritten"] += s.data_bytes - new
        return out

    def shard_bytes(self, shard: PlannedShard) -> int:
        size = self._sizes.get(shard.name)
        if size is None:
            from qtool.io.writer import shard_size

            if shard.action is ShardAction.LINK:
                size = os.path.getsize(shard.source_file)
            else:
                size = shard_size(shard.out_tensors(), shard.metadata)
            self._sizes[shard.name] = size
        return size

    def output_size(self) -> int:
        small = sum(os.path.getsize(self.nv.root / f) for f in self.extra_files)
        return sum(self.shard_bytes(s) for s in self.shards) + small

    def weight_map(self) -> dict[str, str]:
        return {n: s.name for s in self.shards for n in s.names()}

    def input_files(self) -> list[str]:
        """Every source file some output tensor's bytes come from."""
        files = {s.source_file for s in self.shards if s.rows}
        files.update(t.origin.file for s in self.shards for t in s.added)
        return sorted(files)

    def plan_hash(self) -> str:
        """Identity of the output: every shard's name and every tensor's origin byte range, the source
        files' sizes and mtimes, the configs. The link mode is not part of it (output bytes are the same)."""
        h = hashlib.sha256()
        files = set()
        for s in self.shards:
            h.update(json.dumps([s.name, s.action.value, s.metadata]).encode())
            for t in s.tensors:
                o = t.origin
                files.add(o.file)
                h.update(json.dumps([t.name, t.dtype, list(t.shape), o.source, o.file, o.start, o.end]).encode())
        for f in sorted(files) + [str(self.nv.root / e) for e in self.extra_files]:
            st = os.stat(f)
            h.update(json.dumps([f, st.st_size, st.st_mtime_ns]).encode())
        h.update(json.dumps([self.config, self.hf_quant_config], sort_keys=True).encode())
        return h.hexdigest()

    def summary(self) -> dict:
        if self._summary is None:
            self._summary = self._make_summary()
        return dict(self._summary)

    def _make_summary(self) -> dict:
        b = self.bytes_by_action()
        counts = {a.value: sum(1 for s in self.shards if s.action is a) for a in ShardAction}
        from_bf16 = [t for s in self.shards for t in s.added if t.origin.source == "bf16"]
        return {
            "nvfp4": str(self.nv.root),
            "bf16": str(self.bf.root),
            "out": str(self.options.out),
            "flavour": self.flavour,
            "mtp": self.mtp_action,
            "bf16_expert_layers": list(self.options.bf16_expert_layers),
            "shards": counts,
            "tensors": {
                "total": sum(s.num_tensors for s in self.shards),
                "from_bf16": len(from_bf16),
                "unfused": sum(1 for t in from_bf16 if t.origin.slice),
                "removed": len(self.removed),
            },
            "bytes": {**b, "output": self.output_size()},
            "ignore_added": self.ignore_added,
            "extra_files": self.extra_files,
            "warnings": self.warnings,
            "shard_plan": [
                {"name": s.name, "action": s.action.value, "tensors": s.num_tensors, "bytes": s.data_bytes}
                for s in self.shards
            ],
        }


_NUM = re.compile(r"(\d+)")


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in _NUM.split(name)]


# ---- planning ------------------------------------------------------------------------------------


def _origin(source: str, info: TensorInfo, sl: str | None = None, start: int | None = None,
            nbytes: int | None = None) -> Origin:
    s = info.start if start is None else start
    e = info.end if nbytes is None else s + nbytes
    return Origin(source, info.file, info.name, s, e, sl)


def _whole(source: str, name: str, info: TensorInfo) -> PlannedTensor:
    return PlannedTensor(name, info.dtype, info.shape, _origin(source, info))


def _need(cfg: dict, key: str, where: Path) -> int:
    v = cfg.get(key)
    if not isinstance(v, int):
        raise PlanError(f"config lacks text_config.{key}", path=where / "config.json",
                        hint="the checkpoint's config.json is not a Qwen3.5-MoE config")
    return v


ARCH_KEYS = ("hidden_size", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
             "num_hidden_layers")


def _check_same_model(nv: Checkpoint, bf: Checkpoint) -> None:
    a, b = nv.text_config, bf.text_config
    if not b:
        return  # shapes are still checked tensor by tensor
    for key in ARCH_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise PlanError(
                f"the two sources are different models: text_config.{key} differs",
                path=bf.root / "config.json",
                expected=f"{a[key]} (NVFP4 source)",
                got=f"{b[key]} (BF16 source)",
                hint="pass the BF16 original of the model the NVFP4 checkpoint was quantized from",
            )


class _Expect:
    """Shapes the architecture (config) requires of the tensors this assembly writes."""

    def __init__(self, cfg: dict, root: Path) -> None:
        self.H = _need(cfg, "hidden_size", root)
        self.E = _need(cfg, "num_experts", root)
        self.I = _need(cfg, "moe_intermediate_size", root)
        self.Is = cfg.get("shared_expert_intermediate_size", self.I)
        self.L = _need(cfg, "num_hidden_layers", root)

    def shared(self, proj: str) -> tuple[int, ...]:
        return (self.H, self.Is) if proj == "down_proj" else (self.Is, self.H)

    def expert(self, proj: str) -> tuple[int, ...]:
        return (self.H, self.I) if proj == "down_proj" else (self.I, self.H)


def _check_bf16(name: str, info: TensorInfo, shape: tuple[int, ...], what: str) -> None:
    if info.dtype not in FLOAT_DTYPES:
        raise PlanError(f"BF16 source tensor for the {what} is not a float tensor", path=info.file,
                        tensor=name, expected="BF16/F16/F32", got=info.dtype,
                        hint="--bf16 must point at the unquantized original")
    if tuple(info.shape) != tuple(shape):
        raise PlanError(f"BF16 source tensor for the {what} has the wrong shape for this architecture",
                        path=info.file, tensor=name, expected=list(shape), got=list(info.shape),
                        hint="the two sources are different models (compare hidden_size / "
                             "moe_intermediate_size / num_experts in their config.json)")


PROJS = ("gate_proj", "up_proj", "down_proj")


class _Planner:
    def __init__(self, opts: HybridOptions) -> None:
        self.opts = opts
        self.nv = Checkpoint.open(opts.nvfp4, require_config=True)
        self.bf = Checkpoint.open(opts.bf16)
        _check_same_model(self.nv, self.bf)
        self.nv_map = build_map(self.nv)
        self.bf_map = build_map(self.bf)
        self.expect = _Expect(self.nv.text_config, self.nv.root)
        self.removed: set[str] = set()
        # additions: (home NVFP4 shard or None, tensor)
        self.additions: list[tuple[str | None, PlannedTensor]] = []
        self.missing: list[str] = []
        self.warnings: list[str] = []
        self.bf16_units: set[str] = set()
        # NVFP4 tensor names per layer: the per-layer removals below would otherwise scan all ~370k
        # roles of a 397B checkpoint once per layer
        self.names_by_layer: dict[int | None, list[str]] = {}
        for n, r in self.nv_map.roles.items():
            self.names_by_layer.setdefault(r.layer, []).append(n)

    # name translation: the output uses the NVFP4 source's naming
    def bf_name(self, out_name: str) -> str:
        a, b = TEXT_PREFIX[self.nv_map.naming], TEXT_PREFIX[self.bf_map.naming]
        return b + out_name[len(a):] if a != b and out_name.startswith(a) else out_name

    def out_name(self, bf_name: str) -> str:
        a, b = TEXT_PREFIX[self.bf_map.naming], TEXT_PREFIX[self.nv_map.naming]
        return b + bf_name[len(a):] if a != b and bf_name.startswith(a) else bf_name

    def flavour(self) -> str:
        fmts = {m.format for m in self.nv_map.modules.values() if m.format in QUANTIZED_FORMATS}
        from qtool.arch.model_map import Format

        if Format.NVFP4_CT in fmts:
            return "compressed-tensors"
        if Format.NVFP4 in fmts:
            return "modelopt"
        raise PlanError("the --nvfp4 source holds no NVFP4 modules", path=self.nv.root,
                        got=sorted(f.value for f in fmts) or "no quantized modules",
                        hint="pass an NVFP4 checkpoint (ModelOpt or compressed-tensors naming)")

    def home_of(self, names: list[str]) -> str | None:
        homes = sorted((self.nv.shard_of(n) for n in names if n in self.nv.tensors), key=natural_key)
        return homes[0] if homes else None

    def remove_where(self, pred, layer: int | None = None) -> list[str]:
        """Remove the NVFP4 tensors whose role satisfies `pred` (only among `layer`'s when given)."""
        roles = self.nv_map.roles
        names = roles if layer is None else self.names_by_layer.get(layer, [])
        gone = sorted((n for n in names if pred(roles[n])), key=natural_key)
        self.removed.update(gone)
        return gone

    def add(self, home: str | None, t: PlannedTensor) -> None:
        self.additions.append((home, t))

    def bf_info(self, name: str) -> TensorInfo | None:
        info = self.bf.tensors.get(self.bf_name(name))
        if info is None:
            self.missing.append(self.bf_name(name))
        return info

    # ---- the three kinds of replacement ----------------------------------------------------------
    def shared_experts(self) -> None:
        prefix = TEXT_PREFIX[self.nv_map.naming]
        for layer in range(self.expect.L):
            gone = self.remove_where(
                lambda r, layer=layer: r.group is Group.SHARED_EXPERT and r.layer == layer, layer)
            base = f"{prefix}layers.{layer}.mlp.shared_expert."
            home = self.home_of(gone) or self.home_of(
                [n for n in self.names_by_layer.get(layer, []) if self.nv_map.roles[n].group is not Group.MTP])
            for proj in PROJS:
                name = f"{base}{proj}.weight"
                info = self.bf_info(name)
                if info is None:
                    continue
                _check_bf16(info.name, info, self.expect.shared(proj), f"layer {layer} shared expert")
                self.add(home, PlannedTensor(name, info.dtype, info.shape, _origin("bf16", info)))
                self.bf16_units.add(base + proj)

    def expert_layer(self, layer: int) -> None:
        if not 0 <= layer < self.expect.L:
            raise UsageError(f"--bf16-expert-layers names layer {layer}, the model has {self.expect.L}",
                             expected=f"0..{self.expect.L - 1}", got=layer)
        gone = self.remove_where(
            lambda r: r.group is Group.ROUTED_EXPERTS and r.layer == layer, layer)
        home = self.home_of(gone)
        base = f"{TEXT_PREFIX[self.nv_map.naming]}layers.{layer}.mlp.experts"
        for t in self.experts_from(self.bf, "bf16", base, self.bf_name(base), f"layer {layer} routed experts"):
            self.add(home, t)
        self.bf16_units.add(base)

    def experts_from(self, ck: Checkpoint, source: str, out_base: str, src_base: str,
                     what: str) -> list[PlannedTensor]:
        """Per-expert tensors for `out_base` ('...mlp.experts') from `ck`, unfusing when it is fused."""
        E = self.expect.E
        fused_gu = ck.tensors.get(src_base + ".gate_up_proj")
        fused_d = ck.tensors.get(src_base + ".down_proj")
        out: list[PlannedTensor] = []
        if fused_gu is not None or fused_d is not None:
            if fused_gu is None or fused_d is None:
                self.missing.append(src_base + (".gate_up_proj" if fused_gu is None else ".down_proj"))
                return []
            H, I = self.expect.H, self.expect.I
            _check_bf16(fused_gu.name, fused_gu, (E, 2 * I, H), what + " (fused gate_up_proj)")
            _check_bf16(fused_d.name, fused_d, (E, H, I), what + " (fused down_proj)")
            eb = DTYPE_BITS[fused_gu.dtype] // 8
            mat = I * H * eb
            for e in range(E):
                base = fused_gu.start + e * 2 * mat
                out.append(PlannedTensor(f"{out_base}.{e}.gate_proj.weight", fused_gu.dtype, (I, H),
                                         _origin(source, fused_gu, f"[{e}, 0:{I}, :]", base, mat)))
                out.append(PlannedTensor(f"{out_base}.{e}.up_proj.weight", fused_gu.dtype, (I, H),
                                         _origin(source, fused_gu, f"[{e}, {I}:{2 * I}, :]", base + mat, mat)))
                db = DTYPE_BITS[fused_d.dtype] // 8 * H * I
                out.append(PlannedTensor(f"{out_base}.{e}.down_proj.weight", fused_d.dtype, (H, I),
                                         _origin(source, fused_d, f"[{e}, :, :]", fused_d.start + e * db, db)))
            return out
        for e in range(E):
            for proj in PROJS:
                src = f"{src_base}.{e}.{proj}.weight"
                info = ck.tensors.get(src)
                if info is None:
                    self.missing.append(src)
                    continue
                _check_bf16(src, info, self.expect.expert(proj), what)
                out.append(PlannedTensor(f"{out_base}.{e}.{proj}.weight", info.dtype, info.shape,
                                         _origin(source, info)))
        return out

    def mtp(self) -> str:
        nv_has = any(n.startswith(MTP_PREFIX) for n in self.nv.tensors)
        bf_has = any(n.startswith(MTP_PREFIX) for n in self.bf.tensors)
        mode = self.opts.mtp
        if mode is MtpMode.AUTO:
            mode = MtpMode.KEEP if nv_has else (MtpMode.FROM_BF16 if bf_has else MtpMode.KEEP)
            if not nv_has and not bf_has:
                self.warnings.append("neither source has an MTP head; the output has none "
                                     "(speculative decoding with MTP will not work)")
        if mode is MtpMode.KEEP:
            if not nv_has:
                return "none"
            self.unfuse_kept_mtp()
            return "keep"
        gone = self.remove_where(lambda r: r.group is Group.MTP)
        if mode is MtpMode.DROP:
            return "drop" if gone else "none"
        if not bf_has:
            raise PlanError("--mtp from-bf16: the BF16 source has no mtp.* tensors", path=self.bf.root,
                            hint="use --mtp keep or --mtp drop")
        home = self.home_of(gone)
        bf_mtp = sorted((n for n in self.bf.tensors if n.startswith(MTP_PREFIX)), key=natural_key)
        _check_mtp_complete(bf_mtp, self.bf.root)
        fused_bases = sorted({n.rsplit(".", 1)[0] for n in bf_mtp if self.bf_map.roles[n].inner is
                              Group.ROUTED_EXPERTS and self.bf_map.roles[n].expert is None})
        for n in bf_mtp:
            role = self.bf_map.roles[n]
            if role.inner is Group.ROUTED_EXPERTS and role.expert is None:
                continue
            self.add(home, _whole("bf16", n, self.bf.tensors[n]))
        for base in fused_bases:
            for t in self.experts_from(self.bf, "bf16", base, base, "MTP routed experts"):
                self.add(home, t)
        self.bf16_units.update({engine_module(self.bf_map.roles[n].module) for n in bf_mtp})
        return "graft" if not nv_has else "from-bf16"

    def unfuse_kept_mtp(self) -> None:
        modules = self.nv_map.modules
        fused = sorted(m.name for m in modules.values()
                       if m.group is Group.MTP and m.inner is Group.ROUTED_EXPERTS and m.expert is None)
        for base in fused:
            names = [f"{base}.{p}" for p in modules[base].params]
            home = self.home_of(names)
            self.removed.update(names)
            for t in self.experts_from(self.nv, "nvfp4", base, base, "kept MTP routed experts"):
                self.add(home, t)

    # ---- shard layout ----------------------------------------------------------------------------
    def layout(self, limit: int) -> list[PlannedShard]:
        table = self.nv.tensors
        removed = self.removed
        adds: dict[str | None, list[PlannedTensor]] = {}
        for home, t in self.additions:
            adds.setdefault(home, []).append(t)
        shards: list[PlannedShard] = []
        overflow: list[PlannedTensor] = list(adds.pop(None, []))
        for rel in sorted(self.nv.headers, key=natural_key):
            header = self.nv.headers[rel]
            rows = header.tensors.rows  # this shard's rows of the table
            if not rows:
                continue
            kept = sorted((r for r in rows if table.name_at(r) not in removed), key=table.start_at)
            size = sum(map(table.nbytes_at, kept))
            extra = adds.pop(rel, [])
            if len(kept) == len(rows) and not extra:
                shards.append(PlannedShard(rel, ShardAction.LINK, array("I", kept), [], str(self.nv.root / rel),
                                           header.metadata or None, table, size))
                continue
            added: list[PlannedTensor] = []
            for t in extra:
                if size + t.nbytes <= limit or not (kept or added):
                    added.append(t)
                    size += t.nbytes
                else:
                    overflow.append(t)
            if kept or added:
                shards.append(PlannedShard(rel, ShardAction.REBUILD, array("I", kept), added,
                                           str(self.nv.root / rel), header.metadata or None, table, size))
        for rest in adds.values():  # homes that do not exist (cannot happen; kept for safety)
            overflow.extend(rest)
        if overflow:
            by_name = {t.name: t for t in overflow}
            groups = plan_shards([(t.name, t.nbytes) for t in overflow], limit)
            for i, g in enumerate(groups):
                name = NEW_SHARD_TEMPLATE.format(i=i + 1, n=len(groups))
                if name in self.nv.headers:
                    raise PlanError("the NVFP4 source already has a shard with the name qtool gives new "
                                    "shards", path=self.nv.root / name)
                added = [by_name[n] for n in g]
                shards.append(PlannedShard(name, ShardAction.NEW, array("I"), added, metadata={"format": "pt"},
                                           data_bytes=sum(t.nbytes for t in added)))
        return shards


# What an MTP head must hold to be built by the engines' drafters (vLLM qwen3_5_mtp.py, SGLang
# qwen3_5_mtp.py): the input projection and norms, one decoder layer's attention and MoE.
MTP_REQUIRED = ("mtp.fc.", "mtp.norm.", "mtp.pre_fc_norm_embedding.", "mtp.pre_fc_norm_hidden.",
                "mtp.layers.0.self_attn.q_proj.", "mtp.layers.0.self_attn.k_proj.", "mtp.layers.0.self_attn.v_proj.",
                "mtp.layers.0.self_attn.o_proj.", "mtp.layers.0.mlp.gate.", "mtp.layers.0.mlp.experts.")


def _check_mtp_complete(names: list[str], root: Path) -> None:
    """Refuse to graft an incomplete MTP head before anything is written (found only by the output
    checks, after every shard was copied, before)."""
    missing = [r.rstrip(".") for r in MTP_REQUIRED if not any(n.startswith(r) for n in names)]
    if missing:
        raise PlanError(f"the BF16 source's MTP head is incomplete: no {', '.join(missing[:4])}"
                        + (" ..." if len(missing) > 4 else ""), path=root, tensor=missing[0],
                        hint="download the BF16 source's MTP tensors completely (qtool download ... --tensors "
                        "'re:^mtp\\.'), or pass --mtp drop / --mtp keep")


def default_limit(nv: Checkpoint) -> int:
    largest = max((h.file_size for h in nv.headers.values()), default=0)
    return max(5 * 10**9, int(largest * 1.05))


def extra_files(root: Path) -> list[str]:
    """Every non-weight file of the source, relative, sorted (config.json and hf_quant_config.json are
    included: they are rewritten, not copied)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".partial"))
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(".safetensors") or rel in SKIP_FILES:
                continue
            out.append(rel)
    return sorted(out)


def plan_hybrid(opts: HybridOptions) -> HybridPlan:
    """Build and validate the plan. Reads headers and configs only; raises PlanError before any write."""
    if not opts.nvfp4.exists():
        raise CheckpointError("--nvfp4 source not found", path=opts.nvfp4)
    if not opts.bf16.exists():
        raise CheckpointError("--bf16 source not found", path=opts.bf16)
    check_no_overlap(opts.out, (opts.nvfp4, opts.bf16))
    opts.nvfp4, opts.bf16 = opts.nvfp4.resolve(), opts.bf16.resolve()
    p = _Planner(opts)
    flavour = p.flavour()
    p.shared_experts()
    for layer in sorted(set(opts.bf16_expert_layers)):
        p.expert_layer(layer)
    mtp_action = p.mtp()
    if p.missing:
        raise PlanError(
            f"the BF16 source lacks {len(p.missing)} tensor(s) the assembly needs",
            path=p.bf.root,
            tensor=p.missing[0],
            got=", ".join(p.missing[:5]) + (" ..." if len(p.missing) > 5 else ""),
            hint="check that --bf16 is the complete original checkpoint (all shards downloaded)",
        )
    _check_unchanged_shapes(p)
    limit = opts.max_shard_size or default_limit(p.nv)
    shards = p.layout(limit)

    from qtool.ops.assemble.patterns import updated_configs

    config, hq, added = updated_configs(p.nv, flavour, shards, sorted(p.bf16_units, key=natural_key),
                                        p.nv_map.roles)
    files = [f for f in extra_files(p.nv.root)]
    return HybridPlan(opts, p.nv, p.bf, p.nv_map, flavour, shards, sorted(p.removed, key=natural_key),
                      mtp_action, sorted(p.bf16_units, key=natural_key), config, hq, added, files, p.warnings)


def _check_unchanged_shapes(p: _Planner) -> None:
    """Tensors both sources hold unquantized (norms, router, embeddings) must agree in shape: a cheap
    guard against pairing two different models whose configs do not say so."""
    for name, info in p.nv.tensors.items():
        if info.dtype not in FLOAT_DTYPES or name in p.removed:
            continue
        other = p.bf.tensors.get(p.bf_name(name))
        if other is not None and other.dtype in FLOAT_DTYPES and other.shape != info.shape:
            raise PlanError(
                "the two sources are different models: a tensor they both hold differs in shape",
                path=other.file, tensor=name, expected=f"{list(info.shape)} (NVFP4 source)",
                got=f"{list(other.shape)} (BF16 source)",
                hint="pass the BF16 original of the model the NVFP4 checkpoint was quantized from",
            )


__all__ = [
    "HF_QUANT_CONFIG_NAME", "HybridOptions", "HybridPlan", "LinkMode", "MtpMode", "Naming", "Origin",
    "PlannedShard", "PlannedTensor", "ShardAction", "plan_hybrid", "hf_quant_exclude", "config_ignore",
]
