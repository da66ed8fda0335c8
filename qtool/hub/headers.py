"""Header-only stand-ins of Hub checkpoints, for the commands that only read headers and configs
(inspect, verify, serve-config, the plans of --dry-run): `hf:ORG/NAME[@REV]` without downloading 233 GB.

The stand-in is a local directory qtool's other code opens like any checkpoint: the config and tokenizer
files (downloaded and verified through huggingface_hub, in its cache), and each safetensors shard as a
sparse file of the remote file's size holding its real header and the bytes of its small tensors (the
scales and KV scales that checks read; safetensors stores them together, so it is about one range
request a shard) and holes elsewhere. Where a shard's small tensors are spread through it (a streaming
writer's module order: every expert's scalars between its weights, one request each, 92k for the 397B),
only those outside the routed experts are fetched; the experts' are left unread (DEFERRED lists their
byte ranges) until a check asks for them (`fetch_deferred`: only those, many requests at once). Cached by commit under
$QTOOL_CACHE_DIR/hub/<org>--<name>/<commit>/
headers (branch -> commit resolutions are kept in huggingface_hub's cache refs), so a pinned or
already-resolved source works
offline (HF_HUB_OFFLINE=1) or with the network down. Data reads (`verify --deep`) need the real files.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qtool.cache import cache_dir
from qtool.hub import remote_safetensors
from qtool.hub.download import download_files, repo_listing
from qtool.hub.remote_safetensors import RangeReader
from qtool.hub.spec import HubError, HubSpec, cached_commit, hub_offline, is_commit
from qtool.io.files import copy_file
from qtool.io.jsonio import atomic_write_text
from qtool.io.output import OutputDir
from qtool.io.safetensors_header import parse_header_bytes

SMALL_TENSOR_BYTES = 64  # tensors this small are fetched (scalar scales, [1] global scales, KV scales)
GAP_BYTES = 64 << 10  # small tensors this close together are fetched with one request (the gap is read too)
SKIP_SUFFIXES = (".bin", ".pt", ".pth", ".gguf", ".onnx", ".msgpack", ".h5", ".ckpt")  # other weight formats
STATS = ".qtool-headers.json"
DEFERRED = ".qtool-deferred.json"  # shard -> byte ranges of small tensors not fetched yet
PARALLEL = 8  # shards read at once
EAGER_RUNS = 16  # a shard whose small tensors need more range requests than this defers the experts'
HEAD_GUESS = remote_safetensors.HEAD_GUESS  # a shard's first request: its header and the bytes after it
PARALLEL_RANGES = 32  # deferred ranges fetched at once (latency, not bandwidth, bounds them)


def _repo_cache(repo_id: str) -> Path:
    return cache_dir() / "hub" / repo_id.replace("/", "--")


def headers_dir(repo_id: str, commit: str) -> Path:
    return _repo_cache(repo_id) / commit / "headers"


def _from_cache(d: Path) -> tuple[Path, dict]:
    return d, {**json.loads((d / STATS).read_text()), "cached": True}


def _cached(spec: HubSpec) -> Path | None:
    commit = cached_commit(spec)
    d = headers_dir(spec.repo_id, commit) if commit else None
    return d if d is not None and (d / STATS).is_file() else None


def stand_in_commit(path: Path) -> str | None:
    """The commit a header-only stand-in (remote_headers' directory) was read at."""
    try:
        return json.loads((Path(path) / STATS).read_text())["commit"]
    except (OSError, ValueError, KeyError):
        return None


def remote_headers(spec: HubSpec, *, token: str | None = None) -> tuple[Path, dict]:
    """(the stand-in directory, what it took: {"commit", "bytes_moved", "requests", "cached"}).

    A commit-pinned source already cached is used without any request; offline (HF_HUB_OFFLINE=1) a cached
    branch is too; otherwise the revision is resolved (one API call) and whatever is missing fetched."""
    cached = _cached(spec) if (is_commit(spec.revision) or hub_offline()) else None
    if cached is not None:
        return _from_cache(cached)
    if hub_offline():
        raise HubError(
            "the headers of this revision are not cached and HF_HUB_OFFLINE is set",
            path=str(spec),
            hint="run the same command once online (it caches configs and headers: about 90 MB "
            "for the 397B), or unset HF_HUB_OFFLINE",
        )

    try:
        listing = repo_listing(spec, token=token)
    except HubError as e:
        fallback = _cached(spec)
        if fallback is None or "network error" not in e.message:
            raise
        return _from_cache(fallback)  # the Hub is unreachable: what was read before
    out = headers_dir(spec.repo_id, listing.commit)
    if (out / STATS).is_file():
        return _from_cache(out)
    return out, {**_fetch(listing, out, token), "cached": False}


def _fetch(listing, out: Path, token: str | None) -> dict:
    shards = [p for p in listing.files if p.endswith(".safetensors")]
    side = [
        p
        for p in listing.files
        if not p.endswith(".safetensors") and not p.endswith(SKIP_SUFFIXES) and not p.startswith(".")
    ]
    reader = RangeReader(listing, token=token)
    with OutputDir(out, resume=True, force=True, replace_any=True) as tx:
        moved = 0
        for f in download_files(listing, side, token=token).files if side else []:
            (tx.partial / f.path).parent.mkdir(parents=True, exist_ok=True)
            copy_file(f.local, tx.partial / f.path)
            moved += f.size if not f.cached else 0
        # the shards at once: each costs a round trip or two, which is what a header-only job waits for
        with ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="qtool-headers") as pool:
            deferred = dict(
                zip(
                    shards, pool.map(lambda path: _stand_in_shard(reader, path, tx.partial / path), shards), strict=True
                )
            )
        deferred = {s: runs for s, runs in deferred.items() if runs}
        if deferred:
            (tx.partial / DEFERRED).write_text(json.dumps(deferred))
        stats = {
            "commit": listing.commit,
            "repo": listing.spec.repo_id,
            "bytes_moved": moved + reader.stats.bytes,
            "requests": reader.stats.requests,
            "shards": len(shards),
            "side_files": len(side),
            "deferred_ranges": sum(len(r) for r in deferred.values()),
        }
        (tx.partial / STATS).write_text(json.dumps(stats))
        tx.commit()
    return stats


def _stand_in_shard(reader, path: str, dst: Path) -> list[tuple[int, int]]:
    """`dst`: a sparse file of the remote shard's size holding its header and its small tensors' bytes;
    returns the ranges of small tensors left unread (see the module's docstring)."""
    head, end = reader.head(path, HEAD_GUESS)
    size = reader.listing.files[path].size
    header = parse_header_bytes(path, head[8:end], size)
    runs = [(max(a, len(head)), b) for a, b in _small_runs(header.tensors.values()) if b > len(head)]
    deferred: list[tuple[int, int]] = []
    if len(runs) > EAGER_RUNS:
        runs = _small_runs(i for i in header.tensors.values() if not _routed_expert(i.name))
        runs = [(max(a, len(head)), b) for a, b in runs if b > len(head)]
        deferred = [
            r for r in _small_runs(i for i in header.tensors.values() if _routed_expert(i.name)) if r[1] > len(head)
        ]
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        for start, stop in runs:
            os.pwrite(fd, reader.read_bytes(path, start, stop), start)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return deferred


def _routed_expert(name: str) -> bool:
    return ".experts." in name


def _small_runs(tensors) -> list[tuple[int, int]]:
    """Absolute byte ranges covering every small tensor, neighbours within GAP_BYTES merged."""
    spans = sorted((i.start, i.end) for i in tensors if i.nbytes <= SMALL_TENSOR_BYTES)
    runs: list[list[int]] = []
    for a, b in spans:
        if runs and a - runs[-1][1] <= GAP_BYTES:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def fetch_deferred(infos) -> int:
    """Fetch, into their header-only stand-ins, the deferred small tensors among `infos` (TensorInfos a
    check is about to read): only the ranges that hold them, PARALLEL_RANGES requests at once. A no-op for
    files of other checkpoints. Returns the number of ranges fetched."""
    by_dir: dict[str, list] = {}
    for info in infos:
        by_dir.setdefault(os.path.dirname(info.file), []).append(info)
    return sum(
        _fetch_deferred_in(Path(d), wanted) for d, wanted in by_dir.items() if os.path.isfile(os.path.join(d, DEFERRED))
    )


def _fetch_deferred_in(d: Path, wanted: list) -> int:
    deferred = {s: [tuple(r) for r in runs] for s, runs in json.loads((d / DEFERRED).read_text()).items()}
    todo: dict[tuple[str, tuple[int, int]], None] = {}
    for info in wanted:
        shard = Path(info.file).name
        for r in deferred.get(shard, ()):
            if r[0] <= info.start and info.end <= r[1]:
                todo[(shard, r)] = None
    if not todo:
        return 0
    stats = json.loads((d / STATS).read_text())
    if hub_offline():
        raise HubError(
            f"{len(todo)} range(s) of expert scales this check reads were never fetched, and HF_HUB_OFFLINE is set",
            path=f"hf:{stats['repo']}@{stats['commit']}",
            hint="run the same command once online (what it fetches is cached)",
        )
    reader = RangeReader(repo_listing(HubSpec(stats["repo"], stats["commit"])))

    def fetch(item: tuple[str, tuple[int, int]]) -> None:
        shard, (a, b) = item
        data = reader.read_bytes(shard, a, b)
        fd = os.open(d / shard, os.O_WRONLY)
        try:
            os.pwrite(fd, data, a)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=PARALLEL_RANGES, thread_name_prefix="qtool-scalars") as pool:
        list(pool.map(fetch, todo))
    for shard, r in todo:
        deferred[shard].remove(r)
    atomic_write_text(d / DEFERRED, json.dumps({s: runs for s, runs in deferred.items() if runs}))
    return len(todo)
