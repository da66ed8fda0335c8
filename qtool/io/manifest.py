"""`qtool-manifest.json`: what produced an artifact and where every tensor came from.

Contents: qtool version, the exact command, pinned library versions (importlib.metadata), the sources
(path + sha256 of every input file that contributed bytes), every output tensor's origin, and the results
of the checks. Written by streaming, shard by shard, so a 400k-tensor manifest never sits in memory as one
object. No timestamps: the same job gives the same manifest.

sha256 of inputs: for files inside a Hugging Face cache (`.../blobs/<sha256>`), the blob name IS the
LFS sha256 of the content (huggingface_hub file_download.py) and is used as is; for files that
`hf download --local-dir` put in a plain directory, huggingface_hub's own record
(`.cache/huggingface/download/<file>.metadata`: commit, etag, time) holds the LFS sha256 as the etag and
is used while the file has not been modified since (huggingface_hub's own rule, _local_folder.py
read_download_metadata); otherwise the file is hashed once and the digest cached under $QTOOL_CACHE_DIR
(default ~/.cache/qtool) by content identity (qtool.io.digest_cache: a same-size edit with its mtime put
back is hashed again). For a local 397B BF16 source (~800 GB, of which
assemble reads ~15 GB) the difference is reading the whole model or not.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from qtool import __version__
from qtool.errors import WriteError
from qtool.io.digest_cache import file_key, user_cache
from qtool.io.files import copy_range, hash_fd, hash_file, hash_ranges_fd, new_file
from qtool.io.files import hash_file as _hash_file
from qtool.io.input_files import InputFiles
from qtool.io.jsonio import dumps_compact
from qtool.io.output import MANIFEST_NAME
from qtool.io.stream_digest import NO_DIGESTS, DigestSink, StreamDigests
from qtool.redact import SECRET_FLAGS, redact_argv, redact_json, redact_text, without_secrets  # noqa: F401

LIBRARIES = (
    "transformers",
    "safetensors",
    "torch",
    "nvidia-modelopt",
    "compressed-tensors",
    "llmcompressor",
    "huggingface_hub",
)
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


# The manifest section that may differ between two runs of the same job: timings, cache hits, retries,
# resume counters. Every other section of a resumed run's manifest equals an uninterrupted run's.
RUN = "run"


# secrets: one redaction for every printed or written text (qtool/redact.py); re-exported for callers
class InputHasher:
    """sha256 of input files in background threads (hashlib releases the GIL), with a persistent cache.

    `record` (a file in the output's partial directory): every input digest is appended there as soon as
    it is known, and a resumed run's hasher (trust_cache=False: hashed again) compares its digests with
    those the interrupted run recorded, so an input edited between the runs (same size, mtime put back:
    invisible to the journal's quick identity check) is refused before the output is published.

    The rule a resume relies on: a unit (a layer, a shard) is journaled only once the input bytes it used
    are on record (`on_record`): every input hashed by the pool, and the prefix of each input hashed from
    the job's reads that covers the unit's bytes. A resumed run then refuses only inputs whose digest the
    interrupted run had not recorded (`refuse_unproven`), and finished units never rest on those."""

    CHUNK = 8 << 20

    def __init__(
        self,
        workers: int = max(2, min(8, (os.cpu_count() or 2) // 2)),
        trust_cache: bool = True,
        record: Path | None = None,
        from_reads: Iterable[str] = (),
    ) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="qtool-sha256")
        self._stop = threading.Event()  # set by close: the pool's hashes stop within a chunk
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.cache = user_cache()
        self.keys: dict[str, str] = {}  # real path -> its cache key when submitted
        self.trust_cache = trust_cache
        self.record = record
        self.recorded: dict[str, str] = {}
        self.prefixes: dict[str, tuple[int, str]] = {}  # real path -> the longest prefix digest recorded
        if record is not None and record.exists():
            for line in record.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    if "prefix" in rec:
                        if rec["prefix"] >= self.prefixes.get(rec["path"], (0, ""))[0]:
                            self.prefixes[rec["path"]] = (int(rec["prefix"]), rec["sha256"])
                    else:
                        self.recorded[rec["path"]] = rec["sha256"]
                except (ValueError, KeyError, TypeError):
                    break  # a torn last line
        # from_reads: the input files the job reads (a layer stream's shards), hashed from those reads
        # (qtool.io.stream_digest), not read a second time; `finish_streams` hashes what the job did not read
        self.from_reads = {os.path.realpath(f) for f in from_reads}
        # every input opened once, read through that descriptor and checked at the end (qtool.io.input_files);
        # the job's readers get it with the streams (`read_digests`)
        self.files = InputFiles()
        self.streams = (
            StreamDigests(
                on_snapshot=self._note_prefixes if record is not None else None,
                settled=self._settled if record is not None else None,
                inputs=self.files,
            )
            if self.from_reads or record is not None
            else None
        )
        self._trailing: list[Future] = []  # output digests computed by their writers (HashedWrites)
        self._inputs: list[Future] = []  # the pool's input digests (recorded before their future is done)
        self._streamed: dict[str, tuple[str, os.stat_result]] = {}  # path -> (real path, stat when submitted)
        self.changed: set[str] = set()  # inputs whose recorded prefix digest differs from this run's

    @property
    def read_digests(self) -> DigestSink:
        """What the job's readers hand their reads to (a LayerStreamer's `digests`): the inputs hashed from
        those reads are hashed there, not read a second time; it carries the job's input files (`files`), which
        the readers read through."""
        return NO_DIGESTS if self.streams is None else self.streams

    def refuse_unproven(self, inputs: Iterable[str], partial: Path) -> None:
        """A resumed run can prove its inputs unchanged only by their digests: the journal's identity
        (size, mtime, sampled content) misses a same-size edit outside the sampled blocks with the mtime
        put back. An input whose digest the interrupted run had not recorded yet is refused, except one
        hashed from the job's reads: the finished units used only the prefix whose digest it recorded (none
        if it recorded none), which the resumed run checks as it hashes the file again."""
        missing = sorted(
            p for p in inputs if os.path.realpath(p) not in self.recorded and os.path.realpath(p) not in self.from_reads
        )
        if missing:
            raise WriteError(
                f"cannot resume: the interrupted run stopped before it had hashed {len(missing)} "
                "input file(s), so an edit since then cannot be ruled out",
                path=missing[0],
                got=", ".join(missing[:3]),
                hint=f"run again without --resume (it starts over; the unfinished {partial} is replaced)",
            )

    def submit_output(self, path: str, sha256: str | Future | None = None) -> None:
        """Hash a file qtool just wrote (never cached: its digest is what the manifest promises), unless its
        writer hashed the bytes it wrote (`sha256`: the digest, or a Future of it that may hold None: then
        the file is hashed here after all)."""
        if path in self.futures:
            return
        if isinstance(sha256, Future):
            self._trailing.append(sha256)
            self.futures[path] = self._or_hashed(sha256, path)
        else:
            self.futures[path] = _done(sha256) if sha256 else self.pool.submit(_hash_file, path, stop=self._stop)

    def _or_hashed(self, digest: Future, path: str) -> Future:
        """`digest`'s value, or (where it holds None) the file's hash from the pool: no pool thread waits."""
        out: Future = Future()

        def settle(f: Future) -> None:
            try:
                value = f.result()
            except BaseException as e:  # noqa: BLE001 -- raised by results()
                out.set_exception(e)
                return
            if value:
                out.set_result(value)
            else:
                self.pool.submit(_hash_file, path, stop=self._stop).add_done_callback(settle)

        digest.add_done_callback(settle)
        return out

    def known(self, path: str) -> str | None:
        """An input's digest where it is on record, without reading the file: a Hub cache blob's name,
        huggingface_hub's download record, or the sha256 cache (trusted while the file's ctime is the
        recorded one); None where only reading the file would tell."""
        real = os.path.realpath(path)
        opened = self.files.open(real)  # a regular file, checked at the end whatever gives its digest
        recorded = _free_sha256(path)
        if recorded:
            return recorded
        self.keys[real] = file_key(real, opened.stat)  # what `refresh` re-records at the end of the run
        return self.cache.lookup(real, opened.stat) if self.trust_cache else None

    def submit(self, path: str, taken: list[tuple[int, int]] | None = None) -> None:
        """Hash an input: whole, or (`taken`: the byte ranges the job takes of it) those bytes only."""
        if path in self.futures or path in self._streamed:
            return
        real = os.path.realpath(path)
        if taken is not None:
            # never cached: the cache holds whole files' digests; a donor's ranges are a small read
            self._put(path, self.pool.submit(self._hash_taken, path, real, taken))
            return
        on_record = self.known(path)
        if on_record:
            self._put(path, _done(self._note(path, on_record)))
        elif self.streams is not None and real in self.from_reads:  # (there are streams where there are such)
            self.streams.add(real, check=self.prefixes.get(real))
            self._streamed[path] = (real, self.files.open(real).stat)
        else:
            self._put(path, self.pool.submit(self._hash, path, real))

    def _put(self, path: str, f: Future) -> None:
        self.futures[path] = f
        self._inputs.append(f)

    def _settled(self, wait: bool = True) -> bool:
        """Wait until every input the pool hashes is on record (a failed hash raises); wait=False: whether
        they are, without waiting."""
        for f in list(self._inputs):
            if not wait and not f.done():
                return False
            f.result()
        return True

    def wait_pooled(self) -> None:
        """Wait until every input the pool hashes is on record (a failed hash raises)."""
        self._settled()

    def on_record(self, ends: Callable[[], dict[str, int]], wait: bool = True) -> bool:
        """Whether the input bytes a unit used are on record (see the class): every pooled input (waited
        for: small files, or shards hashed since the job started), and of the inputs hashed from the job's
        reads the bytes before `ends()` (path -> end offset; called only when there are such inputs).
        wait=False: never wait, for either (a caller that can journal the unit later, or not at all).
        """
        if self.record is None or self.streams is None:
            return True
        return self.streams.covered(ends() if self.streams.files else {}, wait=wait)

    def finish_streams(self) -> None:
        """Once the job has read what it needs: hash the rest of each input hashed from its reads."""
        for path, (real, before) in sorted(self._streamed.items()):
            self.futures[path] = self.pool.submit(self._finish_stream, path, real, before)
        self._streamed.clear()

    def _finish_stream(self, path: str, real: str, before: os.stat_result) -> str:
        d = cast(StreamDigests, self.streams).files[real]  # (a file hashed from reads has its stream)
        digest = d.finish()
        if d.mismatch:
            self.changed.add(real)
        elif self.files.unchanged(real):  # (else the commit refuses it: no digest of no file is cached)
            self.cache.store(real, digest, before)
        return self._note(path, digest)

    def _note_prefixes(self, prefixes: dict[str, tuple[int, str]]) -> None:
        with self.lock, open(cast(Path, self.record), "a", encoding="utf-8") as f:  # (called only with a record)
            for real, (n, sha) in sorted(prefixes.items()):
                f.write(json.dumps({"path": real, "prefix": n, "sha256": sha}) + "\n")

    def _note(self, path: str, digest: str) -> str:
        """Record an input's digest (before its future is done: `_settled` relies on that)."""
        real = os.path.realpath(path)
        if self.record is not None and real not in self.recorded and real not in self.changed:
            with self.lock, open(self.record, "a", encoding="utf-8") as f:
                f.write(json.dumps({"path": real, "sha256": digest}) + "\n")
        return digest

    def _hash(self, path: str, real: str) -> str:
        opened = self.files.open(real)
        before = opened.stat
        digest = hash_fd(opened.fd, real, stop=self._stop)
        if self.files.unchanged(real):  # (else the commit refuses it: no digest of no file is cached)
            self.cache.store(real, digest, before)
        return self._note(path, digest)

    def _hash_taken(self, path: str, real: str, taken: list[tuple[int, int]]) -> str:
        return self._note(path, hash_ranges_fd(self.files.open(real).fd, real, taken, stop=self._stop))

    def results(self) -> dict[str, str]:
        self.finish_streams()
        try:
            out = {p: f.result() for p, f in sorted(self.futures.items())}
        except Exception:
            self.files.check()  # an input that changed under its hash (truncated: it ended early) is the error
            raise
        self.pool.shutdown()
        real = {p: os.path.realpath(p) for p in out}
        changed = sorted(p for p, d in out.items() if self.recorded.get(real[p], d) != d or real[p] in self.changed)
        if changed:
            raise WriteError(
                f"cannot finish the resumed run: {len(changed)} input file(s) changed since the interrupted run",
                path=changed[0],
                got=", ".join(changed[:3]),
                hint="run again without --resume to start over (the unfinished output would mix old and new inputs)",
            )
        self.files.check()  # every digest is of one unchanged file: only then may the cache learn them
        self.refresh(out)
        return out

    def refresh(self, digests: dict[str, str]) -> None:
        """Re-record the cache entries of the files this run hashed or found (qtool.io.digest_cache): their
        ctime has moved by the links this run made into its output. Called by `results`, and by a caller
        whose own later links would move it again (a build, once every step ran)."""
        for p, d in digests.items():
            real = os.path.realpath(p)
            if real in self.keys:
                self.cache.refresh(real, d, self.keys[real])
        self.cache.save()

    def close(self, keep_files: bool = False) -> None:
        """The end of the job, or an error's way out: every hash thread this job started is stopped and
        joined, none left running into the interpreter's exit (qtool.io.hashed_writes.HashedWrites.stop says why
        that matters); the pool's running ones stop within a chunk (the pool's threads are joined at exit:
        a failed or interrupted 397B job does not wait there for whole input shards to be hashed).
        keep_files: the input files stay open for the commit's check (its caller closes `files`)."""
        self._stop.set()
        # the running hashes stop within a chunk; their descriptors are closed only then (a descriptor closed
        # under a read could be reused by the next open, and the hash would read another file)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if not keep_files:
            self.files.close()
        for digest in self._trailing:
            digest.cancel()  # a no-op on one that is done
        if self.streams is not None:
            self.streams.close()


def _done(value: str) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def hub_recorded_sha256(path: str) -> str | None:
    """The sha256 huggingface_hub recorded when it downloaded `path` into a `--local-dir` (the LFS etag in
    `<dir>/.cache/huggingface/download/<relative path>.metadata`), if the file has not changed since; None
    otherwise (not downloaded that way, a regular non-LFS file whose etag is a git sha1, or modified)."""
    p = Path(os.path.abspath(path))
    for root in p.parents:
        meta_dir = root / ".cache" / "huggingface" / "download"
        if not meta_dir.is_dir():
            continue
        meta = meta_dir / (str(p.relative_to(root)) + ".metadata")
        try:
            _commit, etag, stamp = meta.read_text(encoding="utf-8").splitlines()[:3]
            modified = os.stat(p).st_mtime
        except (OSError, ValueError):
            return None
        etag = etag.strip().strip('"')
        try:
            fresh = modified - 1 <= float(stamp)  # huggingface_hub allows 1 s of mtime imprecision
        except ValueError:
            return None
        return etag if fresh and _HEX64.match(etag) else None
    return None


def write_shards_section(path: Path, shards: Iterable[Any], roots: dict[str, Path]) -> None:
    """Stream the manifest's `"shards": {...}` member to `path` (not fsynced: `write_manifest` copies it
    into the manifest, which is). `shards`: planned shards whose tensors have `.name` and `.origin`
    (source, file, tensor, slice). Written while the shards are being copied, so its CPU time overlaps
    the I/O; one line per tensor, so a 400k-tensor manifest never sits in memory as one object."""
    rel: dict[tuple[str, str], str] = {}  # (source, file) -> path relative to that source's root
    with open(path, "w", encoding="utf-8") as f:
        f.write(' "shards": {')
        for i, s in enumerate(shards):
            f.write(
                ("," if i else "") + f'\n  {json.dumps(s.name)}: {{"action": {json.dumps(s.action.value)}, '
                '"tensors": {'
            )
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
                f.write(("," if j else "") + f"\n   {json.dumps(t.name)}: " + dumps_compact(d))
            f.write("\n  }}")
        f.write("\n }\n}\n")


def source_entry(root: Path, digests: dict[str, str], taken: dict[str, list[tuple[int, int]]] | None = None) -> dict:
    """One `sources` entry: the root and {relative path: {sha256, bytes}} of its files in `digests`. A file the
    job took byte ranges of (`taken`) has the sha256 of those bytes, in file order (`taken_sha256`, over
    `taken_bytes` bytes: the manifest's tensor origins say which), and its whole-file sha256 only where
    that is on record without reading it (a Hub cache blob's name, huggingface_hub's download record)."""
    taken = taken or {}
    files = {}
    for f, d in sorted(digests.items()):
        rel = os.path.relpath(f, root)
        size = os.path.getsize(f)
        if f in taken:
            whole = _free_sha256(f)
            files[rel] = {
                **({"sha256": whole} if whole else {}),
                "taken_sha256": d,
                "taken_bytes": sum(end - start for start, end in taken[f]),
                "bytes": size,
            }
        else:
            files[rel] = {"sha256": d, "bytes": size}
    return {"path": str(root), "files": files}


def _free_sha256(path: str) -> str | None:
    """A file's sha256 where it is on record without reading the file."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and _HEX64.match(name):
        return name
    return hub_recorded_sha256(path)


def write_manifest(
    path: Path,
    *,
    kind: str,
    command: str | None,
    sources: dict[str, dict],
    summary: dict,
    checks: dict,
    files: dict[str, dict] | None = None,
    shards_section: Path | None = None,
    extra: dict | None = None,
    created: bool = True,
) -> None:
    """Write THE manifest (every command's, one schema) to `path`, fsynced: qtool_version, operation,
    command (secrets redacted), libraries, sources ({name: {path, files: {rel: {sha256, bytes}}}}),
    summary, checks, `files` (every output file's sha256 and size, what `verify --deep` compares),
    then the op's own `extra` sections and, for assemble, the streamed `shards_section` (removed
    afterwards)."""
    head = {
        "qtool_version": __version__,
        "operation": kind,
        # False for an in-place change of a checkpoint qtool did not create (qtool.io.output.made_by_qtool)
        "created_by_qtool": created,
        "command": command,
        "libraries": library_versions(),
        "sources": sources,
        "summary": summary,
        "checks": checks,
        "files": files or {},
        **(extra or {}),
    }
    with new_file(path) as f:
        text = json.dumps(redact_json(head), indent=1)  # every field: a token in a path the user typed too
        if shards_section is None:
            f.write((text + "\n").encode())
        else:
            f.write((text[: text.rstrip().rfind("}")].rstrip() + ",\n").encode())
            f.flush()
            with open(shards_section, "rb") as body:
                copy_range(body.fileno(), f.fileno(), 0, os.fstat(body.fileno()).st_size)
    if shards_section is not None:
        os.unlink(shards_section)


def read_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def carried_files(partial: Path, root: Path, changed: set[str], known: dict[str, str] | None = None) -> dict[str, dict]:
    """The manifest's `files` for in-place work (root's new state built in `partial`): every file with its
    sha256, so that `verify --deep` can check each one. Changed files are hashed; unchanged ones (links of
    root's) take the digest this run already has for root's file (`known`: real path -> sha256), else the
    one the checkpoint's previous manifest recorded for the same size, else what InputHasher finds (a Hub
    cache blob's name, huggingface_hub's download record, the sha256 cache) or computes."""
    known = {os.path.realpath(p): d for p, d in (known or {}).items()}
    try:
        before = read_manifest(root / MANIFEST_NAME).get("files") or {}
    except (OSError, ValueError, AttributeError):
        before = {}
    out: dict[str, dict] = {}
    unknown: dict[str, str] = {}  # rel -> root's file, for the hasher
    for p in sorted(partial.rglob("*")):
        rel = p.relative_to(partial).as_posix()
        if not p.is_file() or rel == MANIFEST_NAME or p.name.startswith(".qtool-"):
            continue
        size = p.stat().st_size
        recorded = before.get(rel)
        old: dict = recorded if isinstance(recorded, dict) else {}
        digest = None
        if rel in changed:
            digest = hash_file(p)
        elif p.is_symlink() or p.stat().st_nlink > 1:  # root's own file, linked into the new state
            digest = known.get(os.path.realpath(root / rel))
            if digest is None and old.get("bytes") == size and isinstance(old.get("sha256"), str):
                digest = old["sha256"]
            if digest is None:
                unknown[rel] = str(root / rel)
        else:
            unknown[rel] = str(p)
        out[rel] = {"sha256": digest, "bytes": size}
    if unknown:
        hasher = InputHasher()
        try:
            for f in unknown.values():
                hasher.submit(f)
            found = hasher.results()
        finally:
            hasher.close()
        for rel, f in unknown.items():
            out[rel]["sha256"] = found[f]
    return out


def previous_head(root: Path) -> dict | None:
    """The checkpoint's previous manifest without its bulky sections (kept when an in-place op writes a
    new one: what made the artifact before)."""
    try:
        prev = read_manifest(root / MANIFEST_NAME)
    except (OSError, ValueError):
        return None
    return {k: v for k, v in prev.items() if k not in ("shards", "files")}
