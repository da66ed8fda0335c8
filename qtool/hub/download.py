"""Whole-file downloads through huggingface_hub, each file checked against what the Hub publishes.

- The revision is resolved to a commit once (HfApi.model_info(files_metadata=True), which also lists every
  file's size, git blob id and, for LFS files, the sha256; hf_api.py ModelInfo/RepoSibling/BlobLfsInfo).
- Files come through `hf_hub_download(..., revision=<commit>)`: its cache (HF_HUB_CACHE), token
  (HF_TOKEN / `hf auth login`), endpoint (HF_ENDPOINT) and transfer backend (hf_xet where installed,
  HF_HUB_DISABLE_XET) apply. Within one run a dropped connection is resumed by huggingface_hub's http_get
  (Range request from the bytes already written, file_download.py); across runs the unit of resumption is
  the file: finished files are cache hits.
- huggingface_hub does not hash what it downloads, so we do: LFS files against `lfs.sha256`, regular files
  against the git blob id (sha1 of "blob <size>\\0" + content). A mismatch deletes the cached blob and
  downloads again (`retries` times), then raises VerificationError. Verified digests are remembered under
  $QTOOL_CACHE_DIR/hub-verified.json, keyed by real path, size, mtime and inode, so a rerun does not rehash
  800 GB.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qtool.cache import cache_dir
from qtool.errors import VerificationError, WriteError
from qtool.hub.spec import HubError, HubSpec, hub_errors, hub_offline
from qtool.io.output import OutputDir


@dataclass(frozen=True)
class RemoteFileInfo:
    path: str
    size: int
    blob_id: str | None
    sha256: str | None  # LFS files only

    def to_json(self) -> dict:
        return {"size": self.size, "blob_id": self.blob_id, "sha256": self.sha256}


@dataclass
class RepoListing:
    spec: HubSpec
    commit: str
    files: dict[str, RemoteFileInfo]

    def select(self, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[str]:
        out = []
        for p in sorted(self.files):
            if include and not any(fnmatch.fnmatchcase(p, g) for g in include):
                continue
            if any(fnmatch.fnmatchcase(p, g) for g in exclude):
                continue
            out.append(p)
        return out


def repo_listing(spec: HubSpec, *, token: str | None = None) -> RepoListing:
    """Resolve the revision to a commit and list the files with sizes and hashes (one API call)."""
    from huggingface_hub import HfApi

    with hub_errors(spec):
        info = HfApi().model_info(spec.repo_id, revision=spec.revision, files_metadata=True, token=token)
    if not info.sha:
        raise HubError("the Hub did not return a commit for this revision", path=str(spec))
    files = {}
    for s in info.siblings or []:
        files[s.rfilename] = RemoteFileInfo(s.rfilename, int(s.size or 0), s.blob_id, s.lfs.sha256 if s.lfs else None)
    _pin_ref(spec, info.sha, None)  # remembered: offline, or with the Hub unreachable, this branch still resolves
    return RepoListing(spec, info.sha, files)


# ---- verification ----------------------------------------------------------------------------------


def _verified_path() -> Path:
    return cache_dir() / "hub-verified.json"


_memo_lock = threading.Lock()


def _memo_key(path: str) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _load_memo() -> dict[str, str]:
    try:
        return json.loads(_verified_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_memo(memo: dict[str, str]) -> None:
    p = _verified_path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, sort_keys=True, indent=0))
        os.replace(tmp, p)
    except OSError:
        pass  # an optimisation only


def file_digest(path: str | Path, info: RemoteFileInfo) -> str:
    """sha256 (LFS) or git blob sha1 (regular file) of the local file, streamed."""
    if info.sha256:
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % os.path.getsize(path))
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def check_file(path: str | Path, info: RemoteFileInfo, memo: dict[str, str] | None = None) -> str | None:
    """None when `path` matches the Hub's size and hash, else a description of the mismatch."""
    size = os.path.getsize(path)
    if size != info.size:
        return f"size {size}, expected {info.size}"
    want = info.sha256 or info.blob_id
    if not want:
        return None  # the Hub published no hash (should not happen for model repos)
    key = _memo_key(str(path))
    if memo is not None and memo.get(key) == want:
        return None
    got = file_digest(path, info)
    if got != want:
        return f"{'sha256' if info.sha256 else 'git blob sha1'} {got}, expected {want}"
    if memo is not None:
        with _memo_lock:
            memo[key] = got
    return None


# ---- downloads -------------------------------------------------------------------------------------


@dataclass
class FileResult:
    path: str
    local: Path  # the snapshot path in the HF cache
    size: int
    digest: str | None
    cached: bool  # was already in the cache before this run
    attempts: int

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "digest": self.digest,
            "cached": self.cached,
            "attempts": self.attempts,
        }


@dataclass
class DownloadStats:
    files: list[FileResult] = field(default_factory=list)
    hash_failures: list[str] = field(default_factory=list)


def _cached_path(listing: RepoListing, path: str, cache_dir: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(listing.spec.repo_id, path, cache_dir=cache_dir, revision=listing.commit)
    return Path(got) if isinstance(got, str) else None


def check_space(
    listing: RepoListing, paths: Sequence[str], cache_dir: str | None, free: Callable[[Path], int] | None = None
) -> int:
    """Bytes still to download; WriteError when the cache's filesystem cannot hold them."""
    from huggingface_hub import constants

    need = sum(listing.files[p].size for p in paths if _cached_path(listing, p, cache_dir) is None)
    root = Path(cache_dir or constants.HF_HUB_CACHE)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    have = (free or (lambda p: shutil.disk_usage(p).free))(probe)
    if need > have:
        raise WriteError(
            "not enough free space for the download",
            path=root,
            expected=f"{need / 1e9:.2f} GB free",
            got=f"{have / 1e9:.2f} GB",
            hint="free space, or set HF_HUB_CACHE to a larger disk",
        )
    return need


def download_files(
    listing: RepoListing,
    paths: Sequence[str],
    *,
    cache_dir: str | None = None,
    token: str | None = None,
    retries: int = 1,
    progress: bool = False,
    workers: int = 4,
) -> DownloadStats:
    """Download `paths` at the listing's commit into the HF cache and verify each; returns where they are."""
    from concurrent.futures import ThreadPoolExecutor

    from huggingface_hub import hf_hub_download

    missing = [p for p in paths if p not in listing.files]
    if missing:
        raise HubError(
            f"{len(missing)} file(s) are not in the repository at {listing.commit[:12]}",
            path=str(listing.spec),
            got=", ".join(missing[:5]),
            hint="check --include",
        )
    memo = _load_memo()
    stats = DownloadStats()

    def one(path: str) -> FileResult:
        info = listing.files[path]
        cached = _cached_path(listing, path, cache_dir) is not None
        attempts = 0
        while True:
            attempts += 1
            with hub_errors(listing.spec, path):
                local = Path(
                    hf_hub_download(
                        listing.spec.repo_id, path, revision=listing.commit, cache_dir=cache_dir, token=token
                    )
                )
            problem = check_file(local, info, memo)
            if problem is None:
                return FileResult(path, local, info.size, info.sha256 or info.blob_id, cached, attempts)
            stats.hash_failures.append(f"{path}: {problem}")
            _evict(local)
            cached = False
            if attempts > retries:
                raise VerificationError(
                    "downloaded file does not match the Hub's hash",
                    path=path,
                    expected=info.sha256 or info.blob_id,
                    got=problem,
                    hint="the bytes were corrupted in transit or on disk; rerun the "
                    "download (the bad copy was deleted from the cache)",
                )

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(paths) or 1))) as pool:
            stats.files = list(pool.map(one, paths))
    finally:
        _save_memo(memo)
    return stats


def _evict(snapshot_path: Path) -> None:
    """Remove a bad file from the HF cache: the blob and the snapshot link to it."""
    real = Path(os.path.realpath(snapshot_path))
    for p in (real, snapshot_path):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def snapshot(
    spec: HubSpec,
    *,
    allow_download: bool = True,
    token: str | None = None,
    include: Sequence[str] = (),
    cache_dir: str | None = None,
    progress: bool = False,
) -> Path:
    """A local directory with all (or the included) files of `spec`, verified.

    The HF cache's snapshot directory holds symlinks into ../../blobs, which Checkpoint.open refuses
    (it rejects shards resolving outside the checkpoint), so the files are hard-linked (symlinked across
    filesystems) into $QTOOL_CACHE_DIR/hub/<org>--<name>/<commit>/files/; no bytes are copied.
    Offline (HF_HUB_OFFLINE=1) only what is cached is used."""

    if not allow_download or hub_offline():
        from huggingface_hub import snapshot_download

        with hub_errors(spec):
            snap = Path(
                snapshot_download(
                    spec.repo_id,
                    revision=spec.revision,
                    cache_dir=cache_dir,
                    allow_patterns=list(include) or None,
                    local_files_only=True,
                )
            )
        out = _files_dir(spec, snap.name)
        if not out.is_dir():
            raise HubError(
                "snapshot is cached but was not verified by qtool",
                path=str(spec),
                hint="run once with network access so every file is checked",
            )
        return out
    listing = repo_listing(spec, token=token)
    paths = listing.select(include)
    if not paths:
        raise HubError("no files selected", path=str(spec), hint="check --include")
    out = _files_dir(spec, listing.commit)
    if out.is_dir() and all((out / p).exists() for p in paths):
        return out
    check_space(listing, paths, cache_dir)
    stats = download_files(listing, paths, cache_dir=cache_dir, token=token, progress=progress)

    # qtool's own cache: a directory left incomplete there (no manifest) is replaced
    with OutputDir(out, force=True, replace_any=True) as tx:
        for f in stats.files:
            (tx.partial / f.path).parent.mkdir(parents=True, exist_ok=True)
            tx.placer.place(f.local, tx.partial / f.path)
        tx.commit()
    _pin_ref(spec, listing.commit, cache_dir)
    return out


def _files_dir(spec: HubSpec, commit: str) -> Path:
    return cache_dir() / "hub" / spec.repo_id.replace("/", "--") / commit / "files"


def _pin_ref(spec: HubSpec, commit: str, cache_dir: str | None) -> None:
    """Record branch -> commit in the cache (as snapshot_download does) so offline resolution works."""
    if spec.revision is not None and spec.revision == commit:
        return
    from huggingface_hub import constants

    ref = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{spec.repo_id.replace('/', '--')}" / "refs" / spec.rev
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        if not ref.exists() or ref.read_text() != commit:
            ref.write_text(commit)
    except OSError:
        pass
