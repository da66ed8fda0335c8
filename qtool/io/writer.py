"""Write safetensors shards from byte ranges of existing files (no tensor decoding) or from new bytes,
and plan shard sizes. Header layout matches safetensors' own writer: JSON padded with spaces to a
multiple of 8 bytes, tensors laid out in header order.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from qtool.errors import CheckpointError
from qtool.io.checkpoint import INDEX_NAME
from qtool.io.dtypes import nbytes_for
from qtool.io.files import copy_range, open_new, write_error
from qtool.io.hashed_writes import HashedWrites
from qtool.io.index_file import index_weight_map, read_index
from qtool.io.safetensors_header import read_header


# NamedTuples (cheap to make): a 397B checkpoint's shards are described by ~370k of them.
class FileRange(NamedTuple):
    """Bytes [start, end) of an existing file, copied kernel-side."""

    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class InlineBytes(NamedTuple):
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


Source = FileRange | InlineBytes


class OutTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    source: Source

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


def build_header(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    # The JSON is assembled from per-tensor strings rather than json.dumps of one dict: the same compact
    # text, ~3x faster on a 7k-tensor 397B shard (sizes are needed for every rebuilt shard up front).
    parts: list[str] = []
    if metadata:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    offset = 0
    wants: dict[tuple, int | None] = {}  # (dtype, shape) -> bytes: shards repeat a few shapes thousands of times
    shape_text: dict[tuple, str] = {}
    for t in tensors:
        n = t.source.nbytes
        key = (t.dtype, tuple(t.shape))
        want = wants.get(key, -1)
        if want == -1:
            want = wants[key] = nbytes_for(t.dtype, t.shape)
            shape_text[key] = f'{{"dtype":{json.dumps(t.dtype)},"shape":[{",".join(str(d) for d in t.shape)}],'
        if want != n:
            raise ValueError(f"{t.name}: {n} bytes for {t.dtype}{list(t.shape)} (want {want})")
        parts.append(f'{json_str(t.name)}:{shape_text[key]}"data_offsets":[{offset},{offset + n}]}}')
        offset += n
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


json_str = json.encoder.encode_basestring_ascii  # what json.dumps does to a str, in C


def shard_size(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> int:
    return len(build_header(tensors, metadata)) + sum(t.nbytes for t in tensors)


SHORT_COPY = 64 << 20
TRAILING_COPY_READ = 8 << 20  # the hash trailing a copied shard reads this much at a time (write_shard)


def write_shard(
    path: str | Path,
    tensors: list[OutTensor],
    metadata: dict[str, str] | None = None,
    on_header: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    mode: int = 0o644,
    on_digest: Callable[[object], None] | None = None,
) -> int:
    """Write a shard as a NEW file (an existing file or link at `path` is unlinked, never written
    through: qtool.io.files.open_new); returns its size. fsyncs before returning. `on_header` is called
    once the header is written (readable by others), before the tensor data. Once `stop` is set the copy
    raises Interrupted within a chunk (the file is left incomplete, for the caller's resume logic).
    `on_digest` is handed the file's sha256 (a Future, HashedWrites.digest) once it is written: hashed on
    a thread of its own right behind the copy (the bytes it just wrote, from the page cache), not in a
    second pass once the copy is done (the H200's quantize waited 2.0 s after its last layer for that
    pass over its 5 GB of embeddings, head and vision tower)."""
    path = Path(path)
    header = build_header(tensors, metadata)
    fds: dict[str, int] = {}
    hashing: HashedWrites | None = None
    done = False
    try:
        with os.fdopen(open_new(path, mode), "wb") as out:
            if on_digest is not None:
                # trails the file from its first byte; 8 MiB pieces, as hash_file reads: one buffer per shard
                # being written, up to apply.WRITERS at once (64 MiB ones took assemble's peak RSS from 57
                # to 353 MB)
                hashing = HashedWrites(out, depth=0, path=path, read=TRAILING_COPY_READ)
            (hashing or out).write(header)
            out.flush()
            if on_header is not None:
                on_header()
            dst = out.fileno()
            # Consecutive tensors that are consecutive in the same source file (most of a rebuilt shard)
            # are copied with one call: a 397B shard holds ~7k tensors, many of them 4-byte scales.
            run: list = []  # [file, start, end] of the pending contiguous source range

            def flush() -> None:
                if run:
                    if run[0] not in fds:
                        fds[run[0]] = os.open(run[0], os.O_RDONLY)
                    n = run[2] - run[1]
                    # a short range without the kernel's read-ahead: it would fetch up to 8 MiB of the
                    # neighbours (another layer, read already), evicted again from a page cache too small
                    # for the input; a long one keeps it (the copy's own pace)
                    os.posix_fadvise(
                        fds[run[0]], 0, 0, os.POSIX_FADV_RANDOM if n < SHORT_COPY else os.POSIX_FADV_NORMAL
                    )
                    copy_range(fds[run[0]], dst, run[1], n, stop, hashing.grew if hashing is not None else None)
                    run.clear()

            for t in tensors:
                src = t.source
                if isinstance(src, InlineBytes):
                    flush()
                    if len(src.data) < (1 << 30):
                        os.write(dst, src.data)
                    else:
                        out.write(src.data)
                        out.flush()
                    if hashing is not None:
                        hashing.grew()
                elif run and run[0] == src.file and run[2] == src.start:
                    run[2] = src.end
                else:
                    flush()
                    run.extend((src.file, src.start, src.end))
            flush()
            os.fsync(dst)
            if hashing is not None and on_digest is not None:
                on_digest(hashing.digest())
        done = True
    except OSError as e:
        raise write_error("writing shard failed", e, path) from None
    finally:
        if hashing is not None and not done:  # not written whole (or its close failed): the hash stops
            hashing.stop()
        for fd in fds.values():
            os.close(fd)
    return path.stat().st_size


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def plan_shards(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, order-preserving packing of (name, nbytes) into shards of at most max_shard_bytes
    (a tensor larger than the limit gets a shard of its own), like transformers' save_pretrained."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, nbytes in items:
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def index_json(weight_map: dict[str, str], total_size: int) -> dict:
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def index_text(weight_map: dict[str, str], metadata: dict) -> Iterator[str]:
    """`json.dumps({"metadata": metadata, "weight_map": sorted weight_map}, indent=2) + "\n"` in chunks
    (a generator). The same text without the pure-Python indenting encoder, which for a 397B index (~370k
    entries) took ~3 s and held ~100 MB of pieces before joining them."""
    enc = json_str
    yield '{\n  "metadata": ' + json.dumps(metadata, indent=2).replace("\n", "\n  ") + ',\n  "weight_map": '
    if not weight_map:
        yield "{}\n}\n"
        return
    names = sorted(weight_map)
    step = 4096
    for i in range(0, len(names), step):
        lines = ",\n".join(f"    {enc(n)}: {enc(weight_map[n])}" for n in names[i : i + step])
        yield ("{\n" if i == 0 else ",\n") + lines
    yield "\n  }\n}\n"


def write_index(root: str | Path, weight_map: dict[str, str], metadata: dict | None = None) -> None:
    """(Re)write `root`'s index for `weight_map`: `total_size` recomputed from the shard files on disk,
    other `metadata` keys (e.g. transformers' `total_parameters`) kept, ahead of `total_size`."""
    root = Path(root)
    total = sum((root / f).stat().st_size for f in set(weight_map.values()))
    extra = {k: v for k, v in (metadata or {}).items() if k != "total_size"}
    (root / INDEX_NAME).write_text("".join(index_text(weight_map, {**extra, "total_size": total})), encoding="utf-8")


def append_shard(root: str | Path, tensors: list[OutTensor]) -> None:
    """Add `tensors` to the checkpoint directory `root` as one more shard: renumber `model-i-of-n` to
    `-of-(n+1)` (or turn a lone `model.safetensors` into `model-00001-of-00002`), write the new last
    shard, rewrite the index (`total_size`, and `total_parameters` when the index has it)."""
    root = Path(root)
    if (root / INDEX_NAME).exists():
        index, by_file = read_index(root / INDEX_NAME)
        weight_map = index_weight_map(by_file)
        metadata = dict(index.get("metadata") or {})
    else:
        lone = root / "model.safetensors"
        if not lone.exists():
            raise CheckpointError("no index and no model.safetensors to extend", path=root)
        weight_map = {n: lone.name for n in read_header(lone).tensors}
        metadata = {}
    files = sorted(set(weight_map.values()))
    n = len(files) + 1
    renames = {f: shard_file_name(i, n) for i, f in enumerate(files)}
    for old, new in renames.items():
        os.rename(root / old, root / new)
    weight_map = {k: renames[v] for k, v in weight_map.items()}
    last = shard_file_name(n - 1, n)
    write_shard(root / last, tensors, metadata={"format": "pt"})
    for t in tensors:
        weight_map[t.name] = last
    if isinstance(metadata.get("total_parameters"), int):
        metadata["total_parameters"] += sum(math.prod(t.shape) for t in tensors)
    write_index(root, weight_map, metadata)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '4GiB', '1234' -> bytes."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 4GiB)")
    return int(float(num) * units[unit])
