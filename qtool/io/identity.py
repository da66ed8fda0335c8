"""Inputs' identity for resume keys: size, mtime and a digest of sampled content, and the journal that
records finished units of a run under that identity (qtool.io.output)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import WriteError
from qtool.io.tensor_table import tensor_rows

if TYPE_CHECKING:
    from qtool.io.safetensors_header import TensorInfo

SAMPLE_HEAD = 1 << 20  # at most: the safetensors header (a 397B shard's is ~0.7 MB)
SAMPLE_BLOCK = 4 << 10  # a page
SAMPLE_BLOCKS = 32


def content_sample_digest(path: str | Path) -> str:
    """sha256 of the file's header (a safetensors file's: its 8-byte length and JSON; at most 1 MiB), its
    last page and 32 evenly spaced pages: well under 1 MiB read per file whatever its size, so that a
    re-sharded or edited input is caught at resume time without re-reading hundreds of GB (a same-size
    edit between the samples is caught by the digests the interrupted run recorded: qtool.io.manifest)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        # no read-ahead around the sampled pages: with a disk's default (up to 8 MiB here) each would cost
        # megabytes of disk reads once the page cache no longer holds the input
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        first = os.pread(f.fileno(), SAMPLE_BLOCK, 0)
        head = 8 + int.from_bytes(first[:8], "little") if len(first) >= 8 else len(first)
        head = min(SAMPLE_HEAD, max(len(first), head))
        h.update(first + (os.pread(f.fileno(), head - len(first), len(first)) if head > len(first) else b""))
        if size > head:
            step = max(SAMPLE_BLOCK, (size - head) // SAMPLE_BLOCKS)
            for off in range(head, size, step):
                h.update(os.pread(f.fileno(), SAMPLE_BLOCK, off))
            h.update(os.pread(f.fileno(), SAMPLE_BLOCK, max(0, size - SAMPLE_BLOCK)))
    return h.hexdigest()


def input_identity(files: Iterable[str | Path]) -> dict[str, list]:
    """path -> [size, mtime_ns, content sample digest] for each input file."""
    out: dict[str, list] = {}
    # keyed by the real path: a resume may name the same input as ./src or /abs/src
    for f in sorted({os.path.realpath(f) for f in files}):
        st = os.stat(f)
        # an op's own resume key and the output journal both ask: sampled once per process while the file
        # is unchanged (its ctime too)
        key = (f, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in _SAMPLED:
            _SAMPLED[key] = content_sample_digest(f)
        out[f] = [st.st_size, st.st_mtime_ns, _SAMPLED[key]]
    return out


_SAMPLED: dict[tuple, str] = {}


def tensor_list_text(tensors: Mapping[str, TensorInfo]) -> bytes:
    """`name|dtype|[shape]|its file's size` of every tensor, one line each, sorted by name: what a layer job's
    journal key records of the checkpoint it reads (a --resume against another list starts over). Read
    from a TensorTable's columns with one `stat` per shard (a 397B has ~370k tensors in ~50 shards)."""
    sizes: dict[str, int] = {}
    # "|dtype|[shape]|size\n" of each (file, dtype, shape) met: a 397B repeats a few dozen of them 370k times.
    # Keyed by the objects' ids, not their values: (True, 2) and (1.0, 2) equal (1, 2) as dict keys but are
    # written otherwise; the rows share their file, dtype and shape objects, which live while this runs.
    suffixes: dict[tuple[int, int, int], str] = {}
    lines = []
    for name, file, tensor_dtype, shape in sorted(tensor_rows(tensors)):
        key = (id(file), id(tensor_dtype), id(shape))
        suffix = suffixes.get(key)
        if suffix is None:
            size = sizes.get(file)
            if size is None:
                size = sizes[file] = os.path.getsize(file)
            suffix = suffixes[key] = f"|{tensor_dtype}|{list(shape)}|{size}\n"
        lines.append(name)
        lines.append(suffix)
    return "".join(lines).encode()


def changed_inputs(recorded: dict, now: dict) -> list[str]:
    return sorted(f for f in set(recorded) | set(now) if recorded.get(f) != now.get(f))


def refuse_changed_inputs(recorded: dict, now: dict, partial: Path) -> None:
    changed = changed_inputs(recorded, now)
    if changed:
        raise WriteError(
            f"cannot resume: {len(changed)} input file(s) changed since the interrupted run",
            path=changed[0],
            got=", ".join(changed[:3]),
            hint=f"run again without --resume to start over (the unfinished output {partial} would mix old "
            "and new inputs)",
        )


JOURNAL_NAME = ".qtool-journal.jsonl"  # in the partial output (qtool.io.apply keeps it)


def journaled_files(path: Path) -> set[str]:
    """The units a journal records as finished (file names), without checking its head: what a resumed
    in-place run keeps of its partial state (the executor then checks the plan and the inputs)."""
    out: set[str] = set()
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        try:
            out.add(json.loads(line)["unit"])
        except (ValueError, KeyError, TypeError):
            break
    return out


class Journal:
    """`OUT.partial/.qtool-journal.jsonl`: a head line (the plan hash and the inputs' identity), then one
    line per finished unit (shard, layer), appended only after that unit is durable."""

    def __init__(self, path: Path, plan_hash: str, inputs: dict[str, list], resume: bool) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        self._lock = threading.Lock()  # units finish on several writer threads (qtool.io.apply)
        if resume and path.exists():
            lines = path.read_text().splitlines()
            try:
                head = json.loads(lines[0]) if lines else {}
            except ValueError:
                head = {}
            if head.get("plan_hash") != plan_hash:
                raise WriteError(
                    "cannot resume: the unfinished output was started with a different plan",
                    path=path.parent,
                    expected=f"plan {plan_hash[:16]}",
                    got=f"plan {str(head.get('plan_hash'))[:16]}",
                    hint="run the same command as before (same sources, options and inputs), or drop "
                    "--resume to start over",
                )
            refuse_changed_inputs(head.get("inputs") or {}, inputs, path.parent)
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break  # a torn last line: that unit is redone
                self.done[rec["unit"]] = rec
        else:
            self._write_line({"plan_hash": plan_hash, "inputs": inputs}, mode="w")

    def _write_line(self, obj: dict, mode: str = "a") -> None:
        # No fsync: a unit is recorded only after its own fsync, so a line that reaches the disk always
        # describes a durable unit, and a line lost in a crash only means the unit is redone.
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    def record(self, unit: str, **info: object) -> None:
        rec = {"unit": unit, **info}
        with self._lock:
            self._write_line(rec)
            self.done[unit] = rec

    def file_done(self, partial: Path, name: str) -> bool:
        """A finished file unit whose file is still there with the recorded size."""
        rec = self.done.get(name)
        p = partial / name
        return rec is not None and p.exists() and p.stat().st_size == rec.get("size")
