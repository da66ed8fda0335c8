"""The data of a hybrid assembly: options, planned shards and tensors with the source byte ranges they
come from, and the plan itself (qtool.ops.assemble.plan makes it; qtool.ops.assemble.execute runs it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from array import array
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import NamedTuple

from qtool.arch.model_map import Format, ModelMap
from qtool.io.apply import JOURNAL_NAME
from qtool.io.checkpoint import INDEX_NAME, Checkpoint
from qtool.io.files import LinkMode
from qtool.io.output import RECORDS
from qtool.io.tensor_table import TensorTable
from qtool.io.writer import FileRange, OutTensor, shard_size

NEW_SHARD_TEMPLATE = "model-hybrid-{i:05d}-of-{n:05d}.safetensors"
# Files of a source directory that are never carried over (regenerated, or qtool's own records).
SKIP_FILES = frozenset({INDEX_NAME, JOURNAL_NAME}) | RECORDS
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
        return (
            self._carried(
                lambda name, file, dtype, shape, start, end: PlannedTensor(
                    name, dtype, shape, Origin("nvfp4", file, name, start, end)
                )
            )
            + self.added
        )

    def names(self) -> list[str]:
        return self._carried(lambda name, *_: name) + [t.name for t in self.added]

    @property
    def num_tensors(self) -> int:
        return len(self.rows) + len(self.added)

    def out_tensors(self) -> list[OutTensor]:
        """The shard's tensors as the writer takes them (made straight from the table's columns: a 397B
        shard has ~7k)."""
        out = self._carried(
            lambda name, file, dtype, shape, start, end: OutTensor(name, dtype, shape, FileRange(file, start, end))
        )
        out.extend(
            OutTensor(a.name, a.dtype, a.shape, FileRange(a.origin.file, a.origin.start, a.origin.end))
            for a in self.added
        )
        return out

    def release_tensors(self) -> None:
        """Forget the source table (execute: once the shard's writer has its tensor list)."""
        self.table = None


@dataclass
class HybridOptions:
    """assemble hybrid's options: the one place their defaults live (CLI, build steps, library)."""

    nvfp4: Path
    bf16: Path
    out: Path
    bf16_expert_layers: tuple[int, ...] = ()
    # the layers whose shared expert comes from BF16: None = every layer (the usual hybrid), () = none
    bf16_shared_expert_layers: tuple[int, ...] | None = None
    mtp: MtpMode = MtpMode.AUTO
    link: LinkMode = LinkMode.AUTO
    max_shard_size: int | None = None  # None: 5% above the NVFP4 source's largest shard, at least 5 GB
    force: bool = False  # replace an existing OUT that qtool made
    resume: bool = False
    command: str | None = None  # recorded in the manifest (secrets redacted by the caller)

    def __post_init__(self) -> None:
        # a build recipe gives strings and lists
        self.mtp, self.link = MtpMode(self.mtp), LinkMode(self.link)
        self.bf16_expert_layers = tuple(int(x) for x in self.bf16_expert_layers)
        if self.bf16_shared_expert_layers is not None:
            self.bf16_shared_expert_layers = tuple(int(x) for x in self.bf16_shared_expert_layers)


def bf16_source_patterns(bf16_expert_layers, mtp: str = "auto", shared_expert_layers=None) -> list[str]:
    """Tensor-name patterns of everything `assemble hybrid` can take from the BF16 source: the shared
    experts (and their gates) of `shared_expert_layers` (None: every layer), the routed experts of
    `bf16_expert_layers`, and the MTP head for mtp auto/from-bf16. Used to range-fetch just these from a
    Hub repo instead of ~800 GB."""
    if shared_expert_layers is None:
        pats = ["*.mlp.shared_expert.*", "*.mlp.shared_expert_gate.*"]
    else:
        pats = [
            f"*.layers.{int(layer)}.mlp.shared_expert{tail}"
            for layer in shared_expert_layers
            for tail in (".*", "_gate.*")
        ]
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

    def taken_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """The donor files (those no output shard carries over): file -> the byte ranges the output takes
        from it, merged and in file order (qtool.io.plan.OutputPlan.taken)."""
        carried = {s.source_file for s in self.shards if s.rows}
        ranges: dict[str, list[tuple[int, int]]] = {}
        for s in self.shards:
            for t in s.added:
                if t.origin.file not in carried:
                    ranges.setdefault(t.origin.file, []).append((t.origin.start, t.origin.end))
        return {file: merged_ranges(spans) for file, spans in sorted(ranges.items())}

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

    def _quantized(self, name: str) -> bool:
        """Whether a tensor of the NVFP4 input belongs to a quantized module (not a BF16 one)."""
        role = self.nv_map.roles.get(name)
        module = self.nv_map.modules.get(role.module) if role is not None else None
        return module is not None and module.format not in (None, Format.BF16)

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
            "bf16_shared_expert_layers": (
                None if self.options.bf16_shared_expert_layers is None else list(self.options.bf16_shared_expert_layers)
            ),
            "shards": counts,
            "tensors": {
                "total": sum(s.num_tensors for s in self.shards),
                "from_bf16": len(from_bf16),
                "unfused": sum(1 for t in from_bf16 if t.origin.slice),
                "removed": len(self.removed),
                "removed_quantized": sum(1 for n in self.removed if self._quantized(n)),
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


def merged_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted by start, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
