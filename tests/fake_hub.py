"""A local HTTP server speaking the part of the Hugging Face Hub API that huggingface_hub 1.33 uses
for downloads, with fault injection. Tests point huggingface_hub at it (HF_ENDPOINT, or
`huggingface_hub.constants.ENDPOINT` in-process).

Endpoints emulated (huggingface_hub 1.33 callers in brackets):
- GET  /api/models/{repo}[/revision/{rev}]?blobs=True   [HfApi.model_info / repo_info
       (files_metadata=True -> siblings with size, blobId, lfs{sha256,size,pointerSize})]
- GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=  [HfApi.list_repo_tree, used by
       snapshot_download; paginated through an RFC 5988 `Link: <...>; rel="next"` header,
       utils/_pagination.py]
- POST /api/models/{repo}/paths-info/{rev}  form: paths=..., expand=  [HfApi.get_paths_info]
- HEAD /{repo}/resolve/{rev}/{path}   [get_hf_file_metadata via
       _httpx_follow_hub_redirects_with_backoff: regular files answer 200 with ETag (git blob id),
       X-Repo-Commit and Content-Length; LFS files answer 302 to the "CDN" host with X-Linked-Etag
       (the sha256), X-Linked-Size, X-Repo-Commit. The CDN is a different host name
       (127.0.0.1 vs localhost) so, as with huggingface.co -> cdn-lfs.hf.co, the client stops at the
       redirect and reads the metadata from it (utils/_http.py _is_same_or_hub_host)]
- GET  /{repo}/resolve/{rev}/{path}   [http_get, get_safetensors_metadata-style range reads;
       same redirect for LFS files]
- GET  /cdn/{sha256}                  [the LFS blob, with `Range: bytes=a-b` -> 206 + Content-Range]

Errors carry the X-Error-Code header that utils/_http.py hf_raise_for_status maps to exceptions:
RepoNotFound (404, or 401 for a private repo without the right token), GatedRepo (403),
RevisionNotFound (404), EntryNotFound (404).

Faults (per file path, each with a count of how many requests it affects):
- "drop":         send the headers and half the body, then close the connection;
- "corrupt":      flip one byte in the body;
- "ignore_range": answer 200 with the whole file even when a Range was asked for;
- "404":          the file answers 404 EntryNotFound.
- "expired":      the CDN answers 403 (its signed URL has expired), once per fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeFile:
    path: str
    data: bytes = b""
    # a file served from disk instead (a real-scale sparse stand-in: 233 GB of mostly holes), with a
    # declared LFS sha256: hashing the holes would take minutes, and the tests that serve such files never
    # download their data (a download would fail its sha256 check, as it should)
    disk: Path | None = None
    declared_sha256: str | None = None

    @property
    def size(self) -> int:
        return self.disk.stat().st_size if self.disk is not None else len(self.data)

    def read(self, a: int, b: int) -> bytes:
        """Bytes [a, b] (inclusive, like an HTTP range)."""
        if self.disk is None:
            return self.data[a : b + 1]
        with open(self.disk, "rb") as f:
            f.seek(a)
            return f.read(b + 1 - a)

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return self.declared_sha256 or hashlib.sha256(self.data).hexdigest()

    @property
    def oid(self) -> str:
        # For LFS files the git blob is the pointer file; its exact bytes do not matter here.
        if self.lfs:
            return git_blob_oid(f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n".encode())
        return git_blob_oid(self.data)


@dataclass
class FakeRepo:
    repo_id: str
    commits: dict[str, dict[str, FakeFile]]  # commit sha -> files
    refs: dict[str, str]  # branch/tag -> commit sha
    private_token: str | None = None  # private: only this bearer token sees it
    gated: bool = False  # gated: every file request answers 403 GatedRepo

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


@dataclass
class Fault:
    kind: str  # drop | corrupt | ignore_range | 404
    path: str  # file path in the repo (any repo)
    remaining: int = 1
    skip: int = 0  # let this many matching requests through first


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    authorized: bool = False  # an Authorization header came with it


class FakeHub:
    """Start with `with FakeHub() as hub:`; `hub.endpoint` is the HF_ENDPOINT to use."""

    def __init__(self, page_size: int = 50, latency_s: float = 0.0) -> None:
        self.repos: dict[str, FakeRepo] = {}
        # each request waits this long before it is answered (the real Hub: 50-100 ms a request, answered
        # concurrently): what a client's number of round trips costs; `log` counts them
        self.latency_s = latency_s
        self.faults: list[Fault] = []
        self.log: list[Request] = []
        self.page_size = page_size
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://localhost:{self.port}"
        self.cdn = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    # ---- setup ---------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        commit: str | None = None,
        branch: str = "main",
        private_token: str | None = None,
        gated: bool = False,
    ) -> str:
        """Add (or add a commit to) a repo; returns the commit sha."""
        return self._add(
            repo_id,
            {p: FakeFile(p, d) for p, d in sorted(files.items())},
            commit=commit,
            branch=branch,
            private_token=private_token,
            gated=gated,
        )

    def _add(
        self,
        repo_id: str,
        fmap: dict[str, FakeFile],
        *,
        commit: str | None = None,
        branch: str = "main",
        private_token: str | None = None,
        gated: bool = False,
    ) -> str:
        if commit is None:
            h = hashlib.sha1(repo_id.encode())
            for p, f in fmap.items():
                h.update(p.encode() + f.sha256.encode())
            commit = h.hexdigest()
        repo = self.repos.get(repo_id)
        if repo is None:
            repo = self.repos[repo_id] = FakeRepo(repo_id, {}, {}, private_token, gated)
        repo.commits[commit] = fmap
        repo.refs[branch] = commit
        return commit

    def add_sparse_dir(self, repo_id: str, root: str | Path, *, big: int = 64 << 20, **kw) -> str:
        """Like add_dir, for a real-scale sparse layout (qtool.fixtures.sparse): files above `big` bytes are
        served from disk with a declared sha256 (see FakeFile)."""
        root = Path(root)
        fmap = {}
        for p in sorted(root.rglob("*")):
            if not p.is_file() or ".cache" in p.parts:
                continue
            rel = str(p.relative_to(root))
            if p.stat().st_size > big:
                with open(p, "rb") as f:
                    head = f.read(1 << 20)
                digest = hashlib.sha256(head + str(p.stat().st_size).encode()).hexdigest()
                fmap[rel] = FakeFile(rel, disk=p, declared_sha256=digest)
            else:
                fmap[rel] = FakeFile(rel, p.read_bytes())
        return self._add(repo_id, fmap, **kw)

    def add_dataset(self, repo_id: str, files: dict[str, bytes], **kw) -> str:
        """A dataset repo (served under /api/datasets/ and /datasets/ like the Hub's)."""
        return self.add_repo(DATASET + repo_id, files, **kw)

    def add_dir(self, repo_id: str, root: str | Path, **kw) -> str:
        root = Path(root)
        files = {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and ".cache" not in p.parts
        }
        return self.add_repo(repo_id, files, **kw)

    def fault(self, kind: str, path: str, times: int = 1, skip: int = 0) -> None:
        with self.lock:
            self.faults.append(Fault(kind, path, times, skip))

    def take_fault(self, kind: str, path: str) -> bool:
        with self.lock:
            for f in self.faults:
                if f.kind == kind and f.path == path and f.remaining > 0:
                    if f.skip > 0:
                        f.skip -= 1
                        return False
                    f.remaining -= 1
                    return True
        return False

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    def bytes_served(self, contains: str = "/cdn/") -> int:
        return sum(r.body_bytes for r in self.log if contains in r.path)

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> FakeHub:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- lookups -------------------------------------------------------------------------------
    def blob(self, sha256: str) -> FakeFile | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.sha256 == sha256:
                        return f
        return None


_API = re.compile(
    r"^/api/(?P<rtype>models|datasets)/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree|paths-info)/"
    r"(?P<rev>[^/]+)(?:/(?P<path>.*))?)?$"
)
_RESOLVE = re.compile(r"^/(?:(?P<rtype>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
DATASET = "datasets/"  # dataset repos are kept under this prefix (the Hub's own URL prefix for them)
_CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _entry(f: FakeFile, tree: bool) -> dict:
    if tree:
        e: dict = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
        if f.lfs:
            e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        return e
    e = {"rfilename": f.path, "size": f.size, "blobId": f.oid}
    if f.lfs:
        e["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
    return e


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        # ---- helpers ---------------------------------------------------------------------------
        def _send(
            self,
            status: int,
            body: bytes = b"",
            headers: dict | None = None,
            ctype: str = "application/json",
            length: int | None = None,
        ) -> None:
            # recorded before the response goes out: a client that has its answer finds the request logged
            self._record(status, 0 if self.command == "HEAD" else len(body))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _record(self, status: int, nbytes: int) -> None:
            with hub.lock:
                hub.log.append(
                    Request(
                        self.command,
                        self.path,
                        self.headers.get("Range"),
                        status,
                        nbytes,
                        "Authorization" in self.headers,
                    )
                )

        def _error(self, status: int, code: str, message: str, extra: dict | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})})

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.private_token is not None and self.headers.get("Authorization") != f"Bearer {repo.private_token}":
                self._error(401, "RepoNotFound", "Invalid username or password.")
                return None
            return repo

        def _commit(self, repo: FakeRepo, rev: str) -> str | None:
            sha = repo.resolve(unquote(rev))
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            return sha

        # ---- verbs -----------------------------------------------------------------------------
        def do_GET(self) -> None:
            self._dispatch()

        def do_HEAD(self) -> None:
            self._dispatch()

        def do_POST(self) -> None:
            self._dispatch()

        def _dispatch(self) -> None:
            if hub.latency_s:
                time.sleep(hub.latency_s)
            url = urlparse(self.path)
            path = unquote(url.path)
            query = parse_qs(url.query)
            try:
                if m := _CDN.match(path):
                    return self._cdn(m.group("sha"))
                if m := _RESOLVE.match(path):
                    key = (DATASET if m.group("rtype") else "") + m.group("repo")
                    return self._resolve(key, m.group("rev"), m.group("path"))
                if m := _API.match(url.path):
                    key = (DATASET if m.group("rtype") == "datasets" else "") + unquote(m.group("repo"))
                    return self._api(key, m.group("kind"), m.group("rev"), m.group("path"), query)
                self._error(404, "NotFound", f"no route for {path}")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _api(self, repo_id: str, kind: str | None, rev: str | None, sub: str | None, query: dict) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = self._commit(repo, rev or "main")
            if commit is None:
                return
            files = repo.commits[commit]
            if kind in (None, "revision"):
                blobs = query.get("blobs", ["False"])[0].lower() == "true"
                siblings = [_entry(f, False) if blobs else {"rfilename": f.path} for f in files.values()]
                rid = repo_id.removeprefix(DATASET)
                body = {
                    "id": rid,
                    "modelId": rid,
                    "sha": commit,
                    "private": repo.private_token is not None,
                    "gated": "manual" if repo.gated else False,
                    "siblings": siblings,
                    "tags": [],
                }
                return self._send(200, json.dumps(body).encode())
            if kind == "tree":
                # as the Hub: the folder's files and sub-folders ("directory" entries), all levels with
                # recursive=true, only the first level otherwise
                prefix = unquote(sub).strip("/") + "/" if sub else ""
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                entries, dirs = [], set()
                for p, f in files.items():
                    if not p.startswith(prefix):
                        continue
                    parts = p[len(prefix) :].split("/")
                    for k in range(1, len(parts) if recursive else min(2, len(parts))):
                        d = prefix + "/".join(parts[:k])
                        if d not in dirs:
                            dirs.add(d)
                            entries.append(
                                {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                            )
                    if recursive or len(parts) == 1:
                        entries.append(_entry(f, True))
                start = int(query.get("cursor", ["0"])[0])
                page = entries[start : start + hub.page_size]
                headers = {}
                if start + hub.page_size < len(entries):
                    kind_path = (
                        "datasets/" + repo_id.removeprefix(DATASET)
                        if repo_id.startswith(DATASET)
                        else f"models/{repo_id}"
                    )
                    nxt = (
                        f"{hub.endpoint}/api/{kind_path}/tree/{rev}{'/' + quote(sub) if sub else ''}"
                        f"?recursive={str(recursive)}&cursor={start + hub.page_size}"
                    )
                    headers["Link"] = f'<{nxt}>; rel="next"'
                return self._send(200, json.dumps(page).encode(), headers)
            # paths-info: urlencoded form, `paths` repeated
            n = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(n).decode()) if n else {}
            out = [_entry(files[p], True) for p in form.get("paths", []) if p in files]
            return self._send(200, json.dumps(out).encode())

        def _resolve(self, repo_id: str, rev: str, path: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            if repo.gated:
                return self._error(403, "GatedRepo", "Access to model is restricted: accept the conditions")
            commit = self._commit(repo, rev)
            if commit is None:
                return
            f = repo.commits[commit].get(path)
            if f is None or hub.take_fault("404", path):
                return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": commit})
            common = {"X-Repo-Commit": commit}
            if f.lfs:
                headers = {
                    **common,
                    "Location": f"{hub.cdn}/cdn/{f.sha256}",
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(f.size),
                    "ETag": f'"{f.oid}"',
                }
                return self._send(302, b"", headers)
            return self._body(f, {**common, "ETag": f'"{f.oid}"'})

        def _cdn(self, sha: str) -> None:
            f = hub.blob(sha)
            if f is None:
                return self._error(404, "EntryNotFound", "blob not found")
            if hub.take_fault("expired", f.path):  # the real CDN URL is signed for a limited time
                return self._error(403, "AccessDenied", "Request has expired")
            self._body(f, {"ETag": f'"{sha}"'})

        def _body(self, f: FakeFile, headers: dict) -> None:
            size = f.size
            status = 200
            rng = self.headers.get("Range")
            headers = {**headers, "Accept-Ranges": "bytes"}
            if rng and not hub.take_fault("ignore_range", f.path):
                m = _RANGE.match(rng.strip())
                if m is None:
                    return self._error(416, "RangeNotSatisfiable", f"bad range {rng}")
                a = int(m.group(1))
                b = int(m.group(2)) if m.group(2) else size - 1
                b = min(b, size - 1)
                if a >= size or a > b:
                    return self._error(
                        416, "RangeNotSatisfiable", f"range {rng} of {size}", {"Content-Range": f"bytes */{size}"}
                    )
                status = 206
                headers["Content-Range"] = f"bytes {a}-{b}/{size}"
            else:
                a, b = 0, size - 1
            if self.command == "HEAD":
                return self._send(status, b"", headers, ctype="application/octet-stream", length=b + 1 - a)
            data = f.read(a, b) if b >= a else b""
            if self.command != "HEAD" and hub.take_fault("corrupt", f.path) and data:
                i = len(data) // 2
                data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
            if self.command != "HEAD" and hub.take_fault("drop", f.path):
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                half = data[: len(data) // 2]
                self._record(status, len(half))
                self.wfile.write(half)
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, data, headers, ctype="application/octet-stream")

    return Handler


# ---- test helpers -----------------------------------------------------------------------------


def point_hf_at(monkeypatch, hub: FakeHub, tmp: Path) -> None:
    """huggingface_hub reads HF_ENDPOINT etc. at import time (constants.py), so in-process tests patch the
    constants as well as the environment (subprocesses only need the environment)."""
    from huggingface_hub import constants

    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(tmp / "hf-home"),
        "HF_HUB_CACHE": str(tmp / "hf-cache"),
        "HF_HUB_DISABLE_XET": "1",
        "QTOOL_CACHE_DIR": str(tmp / "qtool-cache"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp / "hf-datasets"))
    import datasets.config as dsc  # the `datasets` library reads these at import time, like huggingface_hub

    monkeypatch.setattr(dsc, "HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(dsc, "HUB_DATASETS_URL", hub.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(dsc, "HF_DATASETS_CACHE", tmp / "hf-datasets")
    monkeypatch.setattr(dsc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp / "hf-home" / "token"))


def make_repo_dir(root: Path, *, layers: int = 4, shards: int = 3, seed: int = 0) -> Path:
    """A small indexed safetensors checkpoint with MoE-like names (random bytes), config + tokenizer files."""
    import random

    from qtool.io.writer import InlineBytes, OutTensor, index_json, write_shard

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(layers):
        p = f"model.language_model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", (64,)),
            (f"{p}.mlp.gate.weight", (8, 64)),
            (f"{p}.mlp.shared_expert.down_proj.weight", (64, 32)),
            (f"{p}.mlp.shared_expert.gate_proj.weight", (32, 64)),
            (f"{p}.mlp.shared_expert.up_proj.weight", (32, 64)),
            (f"{p}.mlp.shared_expert_gate.weight", (1, 64)),
            (f"{p}.mlp.experts.gate_up_proj", (8, 64, 64)),
            (f"{p}.self_attn.q_proj.weight", (64, 64)),
        ]
    names.append(("model.language_model.embed_tokens.weight", (128, 64)))
    per = -(-len(names) // shards)
    wm = {}
    total = 0
    for s in range(shards):
        chunk = sorted(names[s * per : (s + 1) * per])
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        ts = []
        for n, shape in chunk:
            k = 2
            for d in shape:
                k *= d
            ts.append(OutTensor(n, "BF16", shape, InlineBytes(rng.randbytes(k))))
            wm[n] = fname
            total += k
        write_shard(root / fname, ts, {"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps(index_json(wm, total), indent=2))
    (root / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": layers}})
    )
    (root / "tokenizer_config.json").write_text("{}")
    (root / "README.md").write_text("# test repo\n")
    return root


def read_tensor_bytes(root: Path, name: str) -> bytes:
    from qtool.io.checkpoint import Checkpoint

    t = Checkpoint.open(root).tensors[name]
    with open(t.file, "rb") as f:
        f.seek(t.start)
        return f.read(t.nbytes)


def files_equal(a: Path, b: Path) -> bool:
    return os.path.getsize(a) == os.path.getsize(b) and Path(a).read_bytes() == Path(b).read_bytes()


def chat_dataset_files(rows: int, *, split: str = "train_sft", words: int = 60, seed: int = 0) -> dict[str, bytes]:
    """A chat dataset in the Hub's layout (as HuggingFaceH4/ultrachat_200k: parquet shards under data/, the
    splits declared in the README's YAML header), each row a `messages` conversation."""
    import io
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    vocab = [
        "the",
        "model",
        "expert",
        "layer",
        "token",
        "scale",
        "cache",
        "route",
        "shared",
        "attention",
        "why",
        "how",
        "works",
        "serve",
        "GPU",
        "memory",
        "quantize",
        "calibrate",
        "window",
        "context",
    ]

    def text(n: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(n)) + "."

    table = pa.Table.from_pylist(
        [
            {
                "prompt": text(8),
                "messages": [
                    {"role": "user", "content": text(words // 3)},
                    {"role": "assistant", "content": text(words)},
                ],
            }
            for _ in range(rows)
        ]
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    readme = (
        f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: {split}\n"
        f"    path: data/{split}-*\n---\n# a chat dataset for tests\n"
    ).encode()
    return {f"data/{split}-00000-of-00001.parquet": buf.getvalue(), "README.md": readme}
