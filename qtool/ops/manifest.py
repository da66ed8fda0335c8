"""`qtool-manifest.json`: what produced an artifact and where every tensor came from.

Contents: qtool version, the exact command, pinned library versions (importlib.metadata), the sources
(path + sha256 of every input file that contributed bytes), every output tensor's origin, and the results
of the checks. Written by streaming, shard by shard, so a 400k-tensor manifest never sits in memory as one
object. No timestamps: the same job gives the same manifest.

sha256 of inputs: for files inside a Hugging Face cache (`.../blobs/<sha256>`), the blob name IS the
LFS sha256 of the content (huggingface_hub file_download.py) and is used as is; otherwise the file is
hashed once and the digest cached under $QTOOL_CACHE_DIR (default ~/.cache/qtool), keyed by path, size,
mtime and inode.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

LIBRARIES = ("transformers", "safetensors", "torch", "nvidia-modelopt", "compressed-tensors", "llmcompressor",
             "huggingface_hub")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = None
    return out


def command_line(argv: list[str] | None) -> str | None:
    return None if argv is None else shlex.join(argv)


def cache_dir() -> Path:
    return Path(os.environ.get("QTOOL_CACHE_DIR") or Path.home() / ".cache" / "qtool")


class InputHasher:
    """sha256 of input files in background threads (hashlib releases the GIL), with a persistent cache."""

    CHUNK = 8 << 20

    def __init__(self, workers: int = 2) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="qtool-sha256")
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.cache_path = cache_dir() / "sha256-cache.json"
        try:
            self.cache: dict[str, str] = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            self.cache = {}
        self.dirty = False

    @staticmethod
    def _key(path: str) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        return f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"

    def submit(self, path: str) -> None:
        if path in self.futures:
            return
        real = os.path.realpath(path)
        name = os.path.basename(real)
        if os.path.basename(os.path.dirname(real)) == "blobs" and _HEX64.match(name):
            f: Future = Future()
            f.set_result(name)
        else:
            key = self._key(path)
            cached = self.cache.get(key)
            if cached:
                f = Future()
                f.set_result(cached)
            else:
                f = self.pool.submit(self._hash, real, key)
        self.futures[path] = f

    def _hash(self, real: str, key: str) -> str:
        h = hashlib.sha256()
        buf = bytearray(self.CHUNK)
        view = memoryview(buf)
        with open(real, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
        digest = h.hexdigest()
        with self.lock:
            self.cache[key] = digest
            self.dirty = True
        return digest

    def results(self) -> dict[str, str]:
        out = {p: f.result() for p, f in sorted(self.futures.items())}
        self.pool.shutdown()
        if self.dirty:
            try:
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self.cache, indent=0, sort_keys=True))
                os.replace(tmp, self.cache_path)
            except OSError:
                pass  # the cache is an optimisation only
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def write_shards_section(path: Path, shards, roots: dict[str, Path]) -> None:
    """Stream the manifest's `"shards": {...}` member to `path` (not fsynced: `write_manifest` copies it
    into the manifest, which is). `shards`: planned shards whose tensors have `.name` and `.origin`
    (source, file, tensor, slice). Written while the shards are being copied, so its CPU time overlaps
    the I/O; one line per tensor, so a 400k-tensor manifest never sits in memory as one object."""
    import orjson

    rel: dict[tuple[str, str], str] = {}  # (source, file) -> path relative to that source's root
    with open(path, "w", encoding="utf-8") as f:
        f.write(' "shards": {')
        for i, s in enumerate(shards):
            f.write(("," if i else "") + f"\n  {json.dumps(s.name)}: {{\"action\": {json.dumps(s.action.value)}, "
                    "\"tensors\": {")
            for j, t in enumerate(s.tensors):
                o = t.origin
                key = (o.source, o.file)
                if key not in rel:
                    try:
                        rel[key] = os.path.relpath(o.file, roots[o.source])
                    except ValueError:
                        rel[key] = o.file
                d = {"source": o.source, "file": rel[key], "tensor": o.tensor}
                if o.slice:
                    d["slice"] = o.slice
                f.write(("," if j else "") + f"\n   {json.dumps(t.name)}: " + orjson.dumps(d).decode())
            f.write("\n  }}")
        f.write("\n }\n}\n")


def write_manifest(path: Path, *, kind: str, command: str | None, sources: dict[str, dict],
                   shards_section: Path, summary: dict, checks: dict) -> None:
    """Write the manifest to `path` (then fsync): the head (version, command, libraries, sources,
    summary, checks) followed by the `shards_section` file made by `write_shards_section`, which is
    removed afterwards."""
    from qtool import __version__

    head = {
        "qtool_version": __version__,
        "operation": kind,
        "command": command,
        "libraries": library_versions(),
        "sources": sources,
        "summary": summary,
        "checks": checks,
    }
    with open(path, "w", encoding="utf-8") as f:
        text = json.dumps(head, indent=1)
        f.write(text[: text.rstrip().rfind("}")].rstrip() + ",\n")
        f.flush()
        with open(shards_section, "rb") as body:
            from qtool.io.writer import copy_range

            copy_range(body.fileno(), f.fileno(), 0, os.fstat(body.fileno()).st_size)
        os.fsync(f.fileno())
    os.unlink(shards_section)


def read_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
