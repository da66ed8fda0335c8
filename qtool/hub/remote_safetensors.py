"""Tensor-level fetches from safetensors files on the Hub, by HTTP range requests.

1. Headers first: `model.safetensors.index.json` (a regular download) says which shards hold the
   wanted tensors; of those shards only the first 8 bytes (header length N) and bytes 8..8+N (the JSON
   header) are fetched, and the header is validated against the file size the Hub lists (the same
   two-request scheme as huggingface_hub's HfApi.get_safetensors_metadata, hf_api.py; we keep the header
   length, which that API drops, because absolute byte offsets need it).
2. The wanted tensors' byte ranges are coalesced (adjacent tensors -> one request) and streamed into
   `<out>.partial/<shard>.part`, whose first bytes are the header of the output shard (known before any
   data is fetched). The part file is append-only in a fixed order, so its size is the resume point.
3. Every range answer is checked: 206 with the Content-Range we asked for and exactly end-start bytes. A
   server that ignores Range (200 with the whole file) is handled by discarding bytes up to the range
   start and stopping after the range (counted in `ranges_ignored`); a dropped connection is retried
   from the bytes already written.
4. Finished part files are renamed to the shard names of the source, an index is written, and the
   non-weight files (config.json, ...) are downloaded and verified like whole files.

HTTP goes through huggingface_hub's session (utils/_http.py get_session, build_hf_headers): same token,
proxies, user agent and endpoint as the rest of the download; redirects to the CDN are followed by the
session (and httpx drops the Authorization header on the cross-host hop).

Latency, not bandwidth, bounds the small reads (the real Hub answers in 50-100 ms): a file's CDN location is
kept after its first redirect (later ranges go there directly, without the token, which is the Hub's
own business; an expired location is resolved again), and a header is read with one request that also
takes the bytes after it (`head`: where safetensors puts its float32 scales, sorted first).
"""

from __future__ import annotations

import fnmatch
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qtool.errors import ConfigError, HeaderError, PlanError, VerificationError
from qtool.hub.download import RepoListing, download_files
from qtool.hub.spec import HubError, hub_errors
from qtool.io.index_file import read_index
from qtool.io.safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, TensorInfo, parse_header_bytes
from qtool.io.writer import FileRange, OutTensor, build_header

INDEX = "model.safetensors.index.json"
MANIFEST = "qtool-manifest.json"  # qtool.io.output.MANIFEST_NAME
MAX_RETRIES = 5  # per range, reset whenever bytes arrive
# a shard's first request: the 8-byte length, the header and the float32 tensors right after it, in one
# round trip (the 397B's shards, both NVFP4 flavours: header and scalars end by 1.15 MB)
HEAD_GUESS = 5 << 18  # 1.25 MiB


@dataclass
class FetchStats:
    requests: int = 0
    bytes: int = 0
    ranges_ignored: int = 0  # answers that were 200 instead of 206
    bytes_discarded: int = 0  # bytes read past because the server ignored Range
    retries: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


class RangeReader:
    """Byte ranges of Hub files at a fixed commit, through huggingface_hub's HTTP session."""

    def __init__(
        self, listing: RepoListing, *, token: str | None = None, max_retries: int | None = None, backoff_s: float = 0.2
    ) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        self.listing = listing
        self.session = get_session()
        self.headers = build_hf_headers(token=token)
        self.headers["Accept-Encoding"] = "identity"
        self.url = lambda path: hf_hub_url(listing.spec.repo_id, path, revision=listing.commit)
        self.max_retries = MAX_RETRIES if max_retries is None else max_retries
        self.backoff_s = backoff_s
        self.stats = FetchStats()
        self.lock = threading.Lock()  # stats and locations: readers may run in threads
        self.locations: dict[str, str] = {}  # path -> the CDN URL its first request was redirected to

    def _count(self, **add: int) -> None:
        with self.lock:
            for k, v in add.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def read(self, path: str, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Stream bytes [start, end) of `path` into sink, resuming after dropped connections."""
        import httpx
        from huggingface_hub import constants
        from huggingface_hub.utils import hf_raise_for_status

        pos = start
        tries = 0
        while pos < end:
            located = self.locations.get(path)
            # the Hub's token goes to the Hub only (the CDN URL is signed), as httpx does on a redirect
            headers = {
                **(
                    {k: v for k, v in self.headers.items() if k.lower() != "authorization"} if located else self.headers
                ),
                "Range": f"bytes={pos}-{end - 1}",
            }
            self._count(requests=1)
            try:
                with self.session.stream(
                    "GET", located or self.url(path), headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
                ) as r:
                    if r.status_code >= 400 and located:
                        r.read()
                        self.locations.pop(path, None)  # expired: ask the Hub again
                        continue
                    if r.status_code >= 400:
                        r.read()
                        with hub_errors(self.listing.spec, path):
                            hf_raise_for_status(r)
                    if r.history and not located:
                        self.locations[path] = str(r.url)
                    skip = 0
                    if r.status_code == 200:
                        # Range ignored: the body is the whole file from byte 0.
                        self._count(ranges_ignored=1)
                        skip = pos
                    elif r.status_code == 206:
                        got = _content_range_start(r.headers.get("Content-Range"))
                        if got != pos:
                            raise HeaderError(
                                "the server answered a different byte range",
                                path=f"{self.listing.spec} {path}",
                                expected=f"bytes {pos}-{end - 1}",
                                got=r.headers.get("Content-Range"),
                            )
                    else:
                        raise HubError(
                            f"unexpected HTTP status {r.status_code} for a range request",
                            path=f"{self.listing.spec} {path}",
                        )
                    for chunk in r.iter_raw(1 << 20):
                        if skip:
                            if len(chunk) <= skip:
                                skip -= len(chunk)
                                self._count(bytes_discarded=len(chunk))
                                continue
                            self._count(bytes_discarded=skip)
                            chunk = chunk[skip:]
                            skip = 0
                        take = chunk[: end - pos]
                        sink(take)
                        pos += len(take)
                        self._count(bytes=len(take))
                        tries = 0
                        if pos >= end:
                            break
            except httpx.TransportError as e:  # dropped connection, timeout: resume from `pos`
                tries += 1
                self._count(retries=1)
                if tries > self.max_retries:
                    raise HubError(
                        f"network error reading a byte range ({type(e).__name__}: {e})",
                        path=f"{self.listing.spec} {path}",
                        got=f"{tries - 1} retries",
                        hint="check the network and rerun with --resume",
                    ) from None
                time.sleep(self.backoff_s * tries)
        if pos != end:
            raise VerificationError("range read ended early", path=path, expected=end - start, got=pos - start)

    def read_bytes(self, path: str, start: int, end: int) -> bytes:
        buf = bytearray()
        self.read(path, start, end, buf.extend)
        return bytes(buf)

    def head(self, path: str, guess: int = HEAD_GUESS) -> tuple[bytes, int]:
        """(the first bytes of `path`: at least its 8-byte length and header, up to `guess` bytes; the
        header's end 8 + N): one range request, a second only for a header longer than the guess."""
        size = self.listing.files[path].size
        where = f"{self.listing.spec} {path}"
        if size < 8:
            raise HeaderError("remote file is too short to be safetensors", path=where, got=f"{size} bytes")
        head = self.read_bytes(path, 0, min(size, max(8, guess)))
        (n,) = struct.unpack("<Q", head[:8])
        if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise HeaderError(
                "remote header length is not plausible",
                path=where,
                got=n,
                expected=f"1..{min(MAX_HEADER_BYTES, size - 8)}",
            )
        if 8 + n > len(head):
            head += self.read_bytes(path, len(head), 8 + n)
        return head, 8 + n

    def raw_header(self, path: str) -> bytes:
        """The first 8 + N bytes of `path` (the length, then the header JSON)."""
        head, end = self.head(path, guess=8 + (64 << 10))
        return head[:end]

    def header(self, path: str) -> SafetensorsHeader:
        """Fetch and validate the safetensors header of `path`."""
        return parse_header_bytes(path, self.raw_header(path)[8:], self.listing.files[path].size)


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", (value or "").strip())
    return int(m.group(1)) if m else None


# ---- plan ------------------------------------------------------------------------------------------


@dataclass
class TensorFetchOptions:
    names: Sequence[str]  # exact names (exact=True) or patterns: glob, or `re:REGEX` (re.search)
    exact: bool = False
    side_files: Sequence[str] | None = None  # non-weight files to include; None: all of them


def matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    globs = [p for p in patterns if not p.startswith("re:")]
    regexes = []
    for p in patterns:
        if p.startswith("re:"):
            try:
                regexes.append(re.compile(p[3:]))
            except re.error as e:
                raise PlanError(f"bad regular expression in --tensors: {e}", got=p) from None
    return lambda n: any(fnmatch.fnmatchcase(n, g) for g in globs) or any(r.search(n) for r in regexes)


@dataclass
class ShardFetch:
    source: str  # shard file name in the repo (also the output name)
    tensors: list[TensorInfo]  # in source byte order
    runs: list[tuple[int, int]]  # coalesced absolute byte ranges
    header: bytes  # the output shard's header
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class FetchPlan:
    listing: RepoListing
    shards: list[ShardFetch]
    side_files: list[str]
    header_requests: int
    warnings: list[str] = field(default_factory=list)

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    @property
    def data_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    def to_json(self) -> dict:
        return {
            "repo": self.listing.spec.repo_id,
            "revision": self.listing.spec.revision,
            "commit": self.listing.commit,
            "tensors": self.tensor_count,
            "bytes": self.data_bytes,
            "range_requests": sum(len(s.runs) for s in self.shards),
            "header_requests": self.header_requests,
            "shards": {
                s.source: {"tensors": len(s.tensors), "bytes": s.data_bytes, "runs": len(s.runs)} for s in self.shards
            },
            "side_files": self.side_files,
            "warnings": self.warnings,
        }


def plan_fetch(
    listing: RepoListing, opts: TensorFetchOptions, *, token: str | None = None, workers: int = 8
) -> FetchPlan:
    """Read the index and the headers of the shards that hold wanted tensors; nothing else."""
    from concurrent.futures import ThreadPoolExecutor

    want = set(opts.names) if opts.exact else None
    match = (lambda n: n in want) if want is not None else matcher(opts.names)
    weights = sorted(p for p in listing.files if p.endswith(".safetensors"))
    if not weights:
        raise PlanError("the repository has no safetensors files", path=str(listing.spec))
    reader = RangeReader(listing, token=token)
    if INDEX in listing.files:
        st = download_files(listing, [INDEX])
        try:
            _, by_file = read_index(st.files[0].local)  # a 397B index: ~41 MB, read entry by entry
        except ConfigError as e:
            raise HeaderError(f"remote index is malformed ({e})", path=f"{listing.spec} {INDEX}") from None
        if by_file is None:
            raise HeaderError("remote index is malformed (no weight_map)", path=f"{listing.spec} {INDEX}")
        shards = sorted(f for f, names in by_file.items() if any(match(n) for n in names))
        unknown = [s for s in shards if s not in listing.files]
        if unknown:
            raise HeaderError(
                "the index names shards that are not in the repository",
                path=f"{listing.spec} {INDEX}",
                got=", ".join(unknown[:3]),
            )
    else:
        shards = weights
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(shards) or 1))) as pool:
        headers = dict(zip(shards, pool.map(reader.header, shards), strict=True))
    found: set[str] = set()
    out: list[ShardFetch] = []
    for s in shards:
        h = headers[s]
        sel = sorted((t for n, t in h.tensors.items() if match(n)), key=lambda t: t.start)
        if not sel:
            continue
        found.update(t.name for t in sel)
        runs: list[tuple[int, int]] = []
        for t in sel:
            if runs and runs[-1][1] == t.start:
                runs[-1] = (runs[-1][0], t.end)
            else:
                runs.append((t.start, t.end))
        outs = [OutTensor(t.name, t.dtype, t.shape, FileRange(s, t.start, t.end)) for t in sel]
        out.append(ShardFetch(s, sel, runs, build_header(outs, h.metadata or None), dict(h.metadata)))
    if want is not None:
        missing = sorted(want - found)
        if missing:
            raise PlanError(
                f"{len(missing)} requested tensor(s) are not in the repository",
                path=f"{listing.spec}@{listing.commit[:12]}",
                tensor=missing[0],
                got=", ".join(missing[:5]),
                hint="the repo is not the model the plan expects",
            )
    if not out:
        raise PlanError(
            "no tensor matches --tensors",
            path=str(listing.spec),
            got=", ".join(opts.names),
            hint="patterns are globs (model.layers.*.mlp.shared_expert.*) or re:REGEX",
        )
    side = [p for p in listing.files if not p.endswith(".safetensors") and p != INDEX and not p.startswith(".")]
    if opts.side_files is not None:
        keep = set(opts.side_files)
        side = [p for p in side if p in keep]
    return FetchPlan(listing, out, sorted(side), reader.stats.requests)
