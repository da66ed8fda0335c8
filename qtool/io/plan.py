"""An output as data: what every file of an output directory will be, decided before anything is written.

Each writing op reads its inputs (Checkpoint + ModelMap), then a pure decide step returns an `OutputPlan`:
  Link(name, source)          an input file placed unchanged (reflink / hard link / copy: io.files.Placer)
  Copy(name, source)          a small side file copied byte for byte (a file of its own)
  Shard(name, tensors, meta)  a safetensors shard written from byte ranges of sources, inline bytes, or
                              values the op computes later (`Pending`, e.g. calibrated KV scales); `fed`:
                              its sources' bytes come from the producer's own reads of them
  Produced(name, tensors)     a shard a streaming producer writes during execution (quantize's layers, a
                              range-fetched Hub shard); `tensors` is the header it promises
  Json(name, obj, style)      a JSON file (configs, the index) in a given file's own formatting
  Text(name, text)            a small text file, byte for byte
  Index(name, map, metadata)  the safetensors index in transformers' layout
  Remove(name)                in-place work only: a file the new state of the checkpoint no longer has
plus what its manifest records (kind, sources, summary, checks, op-specific sections). One executor
(qtool.io.apply.write_output) runs every plan; `--dry-run` prints `describe()`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

from qtool.errors import CheckpointError
from qtool.io import writer
from qtool.io.checkpoint import Checkpoint
from qtool.io.jsonio import JsonStyle, dumps
from qtool.io.output import RECORDS
from qtool.io.safetensors_header import SafetensorsHeader, read_header
from qtool.io.tensor_table import TensorTable
from qtool.io.writer import FileRange, InlineBytes, OutTensor, build_header, json_str, shard_size

if TYPE_CHECKING:
    from qtool.io.checkpoint import Checkpoint


class Pending(NamedTuple):
    """Bytes the op computes during execution (given to the executor as `values[key]`), of a known size."""

    key: str
    nbytes: int


class Link(NamedTuple):
    name: str
    source: str


class Copy(NamedTuple):
    name: str
    source: str


class Shard(NamedTuple):
    name: str
    # a list, or a function that makes it when the writer starts: a 397B plan keeps its ~370k tensors as
    # table rows (qtool.ops.assemble.model.PlannedShard) rather than as objects
    tensors: Sequence[OutTensor] | Callable[[], list[OutTensor]]
    metadata: dict | None = None
    size: int | None = None  # the file's size when the planner already knows it
    # the producer reads these sources itself (a layer-streamed job's layers): it hands their bytes over
    # (write_output's done.feed), and the shard is written from them then, not copied from the input again
    fed: bool = False


class Produced(NamedTuple):
    name: str
    tensors: Sequence[OutTensor]  # the promised header (sources: Pending of the tensor's size)
    metadata: dict | None = None


class Json(NamedTuple):
    name: str
    obj: dict
    style: JsonStyle | None = None


class Text(NamedTuple):
    name: str
    text: str


class Index(NamedTuple):
    """A `model.safetensors.index.json` in transformers' own layout (qtool.io.writer.index_text: the
    same text as json.dumps(indent=2), streamed: a 397B index has ~370k entries)."""

    name: str
    weight_map: dict | Callable[[], dict]  # or a function that makes it when it is written
    metadata: dict


class Remove(NamedTuple):
    name: str


Entry = Link | Copy | Shard | Produced | Json | Text | Index | Remove


def checkpoint_files(root: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of every file under `root`, in sub-folders too, without qtool's bookkeeping
    (`.qtool-*`, its manifest and a build step's marker: qtool.io.output.RECORDS) and caches (`.cache/`):
    what an output made from `root` carries over. An entry that is
    neither a regular file nor a directory (a FIFO, a device, a dangling symlink, a symlink loop) is a named
    error: a copy silently without it would be worse."""
    out = []
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if ".cache" in rel.parts or p.name.startswith(".qtool-") or p.is_dir() or rel.as_posix() in RECORDS:
            continue
        if not p.is_file():
            kind = "a dangling symlink or a symlink loop" if p.is_symlink() else "a FIFO, a device or a socket"
            raise CheckpointError(
                f"{p.relative_to(root).as_posix()} is {kind}, not a regular file",
                path=p,
                hint="replace it with the real file, or remove it from the checkpoint",
            )
        out.append((p.relative_to(root).as_posix(), p))
    return out


def unchanged_files(root: Path, changed: set[str]) -> list[Link]:
    """Links of every file under `root` except `changed` ones and qtool's own records (checkpoint_files):
    what a new output keeps of its input unchanged."""
    return [Link(rel, str(p)) for rel, p in checkpoint_files(root) if rel not in changed]


def tensors_of(entry: Shard | Produced) -> list[OutTensor]:
    t = entry.tensors
    return t() if callable(t) else list(t)


def promised(name: str, dtype: str, shape: Sequence[int], nbytes: int) -> OutTensor:
    """A tensor of a Produced shard's promised header."""
    # a promise in the source's place: the executor writes the value given for it
    return OutTensor(name, dtype, tuple(shape), Pending(name, nbytes))  # type: ignore[arg-type]


@dataclass
class OutputPlan:
    kind: str  # the manifest's "operation"
    files: list[Entry]
    sources: dict[str, Path | dict]  # the manifest's sources: name -> root directory (or a ready entry)
    inputs: list[str]  # every input file whose bytes reach the output (identity for --resume, sha256)
    # inputs the job takes only these byte ranges of (assemble's BF16 donor files): their digest is the
    # sha256 of those bytes, not of the whole file (a 397B's shared experts are ~1% of its 800 GB of BF16)
    taken: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # op-specific manifest sections
    hash: str | None = None  # the planner's own identity of the output (assemble: ~370k tensors, cheaper)
    _shard_sizes: dict[str, int] = field(default_factory=dict, repr=False, compare=False)  # file_size's
    _json_bytes: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)  # json_bytes'

    def entries(self, *kinds: type) -> list:
        return [e for e in self.files if isinstance(e, kinds)]

    def names(self) -> list[str]:
        return [e.name for e in self.files if not isinstance(e, Remove)]

    def plan_hash(self) -> str:
        """Identity of the output: every file's name and what it is made of (sources' byte ranges, the JSON,
        inline bytes' digests). Inputs' identity is kept apart (the journal compares it separately)."""
        if self.hash is not None:
            return self.hash
        h = hashlib.sha256(self.kind.encode())
        paths: dict[str, str] = {}  # a source file's absolute path, as JSON
        for e in self.files:
            h.update(type(e).__name__.encode())
            if isinstance(e, (Link, Copy)):
                h.update(json.dumps([e.name, os.path.abspath(e.source)]).encode())
            elif isinstance(e, (Shard, Produced)):
                h.update(json.dumps([e.name, e.metadata]).encode())
                h.update(_tensor_keys(tensors_of(e), paths).encode())
            elif isinstance(e, Json):
                h.update(json.dumps([e.name, self.json_bytes(e).decode()]).encode())
            elif isinstance(e, Text):
                h.update(json.dumps([e.name, e.text]).encode())
            elif isinstance(e, Index):
                h.update(json.dumps([e.name, e.metadata, sorted(index_map(e).items())]).encode())
            else:
                h.update(e.name.encode())
        return h.hexdigest()

    def json_bytes(self, entry: Json) -> bytes:
        """A Json entry's file, made once: the hash, the free-space check and the writer all need it (a
        397B checkpoint's index kept in its source's style has ~370k entries; json's indenting encoder
        takes ~1 s for it)."""
        data = self._json_bytes.get(entry.name)
        if data is None:
            data = self._json_bytes[entry.name] = dumps(entry.obj, entry.style).encode()
        return data

    def file_size(self, entry: Entry) -> int:
        """Bytes the entry's file will have (a Link's: its source's). A shard's is computed once (its header
        is built to know its length: ~6k tensors a 397B layer; header_checkpoint fills this in too)."""
        if isinstance(entry, (Link, Copy)):
            return os.path.getsize(entry.source)
        if isinstance(entry, Shard) and entry.size is not None:
            return entry.size
        if isinstance(entry, (Shard, Produced)):
            size = self._shard_sizes.get(entry.name)
            if size is None:
                size = self._shard_sizes[entry.name] = shard_size(tensors_of(entry), entry.metadata)
            return size
        if isinstance(entry, Json):
            return len(self.json_bytes(entry))
        if isinstance(entry, Text):
            return len(entry.text.encode())
        if isinstance(entry, Index):
            return 100 * len(index_map(entry))  # about; only the free-space check asks
        return 0

    def describe(self) -> dict:
        """What --dry-run prints: each file with what it will be."""
        how = {
            Link: "unchanged",
            Copy: "copied",
            Shard: "written",
            Produced: "computed",
            Json: "written",
            Text: "written",
            Index: "written",
            Remove: "removed",
        }
        out: dict[str, list[str]] = {}
        for e in self.files:
            out.setdefault(how[type(e)], []).append(e.name)
        return {"operation": self.kind, "files": out}


def index_map(entry: Index) -> dict:
    """An Index entry's weight map (tensor -> shard), made now where the plan holds a function for it."""
    return entry.weight_map() if callable(entry.weight_map) else entry.weight_map


def index_text_of(entry: Index) -> Iterator[str]:
    return writer.index_text(index_map(entry), entry.metadata)


def _tensor_keys(tensors: list[OutTensor], paths: dict[str, str]) -> str:
    """The text plan_hash hashes for a shard's tensors: `json.dumps([name, dtype, shape, _source_key])` of
    each, concatenated (the same bytes, so plan hashes, which a --resume compares with its journal's, are
    unchanged), written without json.dumps for the usual sources: a 397B quantize hashes 372k tensors
    (2.2 s that way on the 2-core VM). `paths` caches each source file's absolute path as JSON."""
    enc = json_str
    shapes: dict[tuple, str] = {}  # each distinct all-int shape's JSON
    parts = []
    for t in tensors:
        src, shape = t.source, t.shape
        # str() of an int is its JSON; of a bool or a float it is not (json.dumps below). Checked before the
        # lookup: (True, 2) and (1.0, 2) are equal to (1, 2) as dict keys
        if type(shape) is tuple and all(type(d) is int for d in shape):
            text = shapes.get(shape)
            if text is None:
                text = shapes[shape] = ", ".join(map(str, shape))
        else:
            text = None
        if isinstance(src, FileRange) and type(src.start) is int and type(src.end) is int:
            f = paths.get(src.file)
            if f is None:
                f = paths[src.file] = enc(os.path.abspath(src.file))
            key = f'["range", {f}, {src.start}, {src.end}]'
        elif isinstance(src, Pending) and type(src.key) is str and type(src.nbytes) is int:
            key = f'["pending", {enc(src.key)}, {src.nbytes}]'
        else:
            key = None
        if text is None or key is None or type(t.name) is not str or type(t.dtype) is not str:
            parts.append(json.dumps([t.name, t.dtype, list(shape), _source_key(src)]))
        else:
            parts.append(f"[{enc(t.name)}, {enc(t.dtype)}, [{text}], {key}]")
    return "".join(parts)


def _source_key(src: object) -> list:
    if isinstance(src, FileRange):
        return ["range", os.path.abspath(src.file), src.start, src.end]
    if isinstance(src, InlineBytes):
        return ["bytes", hashlib.sha256(src.data).hexdigest()]
    assert isinstance(src, Pending)  # (the third kind of source)
    return ["pending", src.key, src.nbytes]


def resolve(tensors: list[OutTensor], values: dict[str, bytes]) -> list[OutTensor]:
    """The shard's tensors with every Pending source replaced by its computed bytes."""
    out = []
    for t in tensors:
        if isinstance(t.source, Pending):
            data = values.get(t.source.key)
            if data is None or len(data) != t.source.nbytes:
                raise ValueError(f"{t.name}: the op gave no {t.source.nbytes}-byte value for {t.source.key}")
            t = t._replace(source=InlineBytes(data))
        out.append(t)
    return out


def fed_in(tensors: list[OutTensor], given: dict) -> list[OutTensor]:
    """The shard's tensors with the bytes the producer read of their sources (tensor name -> a buffer of
    the tensor's bytes) in place of those sources; the others keep theirs (copied from the input)."""
    out = []
    for t in tensors:
        data = given.get(t.name)
        if data is not None:
            if len(data) != t.source.nbytes:
                raise ValueError(f"{t.name}: the producer gave {len(data)} bytes, the shard wants {t.source.nbytes}")
            t = t._replace(source=InlineBytes(data))
        out.append(t)
    return out


def header_checkpoint(
    root: Path, plan: OutputPlan, config: dict | None, hf_quant_config: dict | None = None, *, as_written: bool = False
) -> Checkpoint:
    """A Checkpoint of the planned output made from the plan alone (nothing written yet): every shard with
    the header the writer will give it; a tensor copied from a source points at the source's bytes (so it
    can be read), a new one at its planned place in the output. Lets a decide step compute what depends on
    the output's tensors (quantization configs, ignore lists, findings) before execution.
    `as_written`: every tensor at its place in the output under `root` (a copied one too), so that values
    read through it come from the written files once they are there."""
    table = TensorTable()
    headers = {}
    for e in plan.files:
        if isinstance(e, Link) and e.name.endswith(".safetensors"):
            h = read_header(e.source)
            if as_written:
                path, first = str(root / e.name), len(table)
                for info in h.tensors.values():
                    table.add(info.name, path, info.dtype, tuple(info.shape), info.start, info.end)
                rows = range(first, len(table))
            else:
                path, rows = h.path, table.extend(cast(TensorTable, h.tensors))  # (read just now: its own table)
            headers[e.name] = SafetensorsHeader(
                path, h.header_len, h.data_start, h.file_size, h.metadata, table.slice(rows)
            )
        elif isinstance(e, (Shard, Produced)):
            tensors = tensors_of(e)
            head = len(build_header(tensors, e.metadata))
            path, first, offset = str(root / e.name), len(table), head
            for t in tensors:
                src = t.source
                if isinstance(src, FileRange) and not as_written:
                    table.add(t.name, src.file, t.dtype, tuple(t.shape), src.start, src.end)
                else:
                    table.add(t.name, path, t.dtype, tuple(t.shape), offset, offset + src.nbytes)
                offset += src.nbytes
            headers[e.name] = SafetensorsHeader(
                path, head - 8, head, offset, dict(e.metadata or {}), table.slice(range(first, len(table)))
            )
            plan._shard_sizes[e.name] = offset  # the header was built for its length: file_size's answer
    return Checkpoint(
        root=Path(root), tensors=table, headers=headers, index=None, config=config, hf_quant_config=hf_quant_config
    )
