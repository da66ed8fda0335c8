"""Range-fetched tensors written as a checkpoint (the execute half of `download --tensors`; the plan, the
remote headers and the range reader are in qtool.hub.remote_safetensors). Each shard is a Produced entry
of an output plan (qtool.io.plan): its header is known from the remote headers, its bytes arrive by range
requests into a `.part` file that a resumed run continues."""

from __future__ import annotations

import os
from pathlib import Path

from qtool.errors import VerificationError, WriteError
from qtool.hub.download import RepoListing, download_files
from qtool.hub.remote_safetensors import INDEX, FetchPlan, RangeReader, ShardFetch
from qtool.io.apply import OutputJob, write_output
from qtool.io.checkpoint import Checkpoint
from qtool.io.manifest import RUN
from qtool.io.plan import Index, Link, OutputPlan, Produced, promised


def hub_source(listing: RepoListing, paths) -> dict:
    """The manifest's source entry for a Hub repo at its commit: the fetched files' sha256 (LFS) and sizes."""
    paths = set(paths)
    return {
        "path": f"hf:{listing.spec.repo_id}@{listing.commit}",
        "repo": listing.spec.repo_id,
        "revision": listing.spec.revision,
        "commit": listing.commit,
        "files": {p: {"sha256": f.sha256, "bytes": f.size} for p, f in listing.files.items() if p in paths},
    }


def fetch_tensors(
    plan: FetchPlan, tx, *, token: str | None = None, progress: bool = False, command: str | None = None
) -> dict:
    """Write the planned tensors as a checkpoint in the output transaction `tx` (qtool.io.output.OutputDir,
    entered: `OUT.partial/`, kept for --resume) through the shared executor; returns a report. Each shard
    is Produced: its header is known from the remote headers, its bytes come by range requests."""
    partial = tx.partial
    sides = download_files(plan.listing, plan.side_files, token=token) if plan.side_files else None
    files: list = [
        Produced(s.source, [promised(t.name, t.dtype, t.shape, t.nbytes) for t in s.tensors], s.metadata)
        for s in plan.shards
    ]
    files += [Link(f.path, str(f.local)) for f in (sides.files if sides else [])]
    weight_map = {t.name: s.source for s in plan.shards for t in s.tensors}
    files.append(Index(INDEX, weight_map, {"total_size": plan.data_bytes}))
    fetched = [s.source for s in plan.shards] + [f.path for f in (sides.files if sides else [])]
    output = OutputPlan(
        "download",
        files,
        sources={"hub": hub_source(plan.listing, fetched)},
        inputs=[str(f.local) for f in (sides.files if sides else [])],
        summary={"repo": plan.listing.spec.repo_id, "commit": plan.listing.commit},
    )
    report = {
        **plan.to_json(),
        "origins": {
            s.source: {"sha256": plan.listing.files[s.source].sha256, "runs": [list(r) for r in s.runs]}
            for s in plan.shards
        },
        "side_file_digests": {f.path: f.digest for f in sides.files} if sides else {},
    }
    # a resumed fetch continues only the same commit's bytes (a branch may have moved since)
    pinned = partial / ".qtool-download-commit"

    if pinned.exists() and pinned.read_text().strip() != plan.listing.commit:
        raise WriteError(
            "cannot resume: the unfinished download is of another commit",
            path=partial,
            expected=plan.listing.commit,
            got=pinned.read_text().strip(),
            hint=f"resume at that commit (REPO@{pinned.read_text().strip()}) or drop --resume",
        )
    pinned.write_text(plan.listing.commit)

    run: dict = {"header_requests": report.pop("header_requests", None)}  # the header cache's doing

    def produce(_done) -> None:
        reader = RangeReader(plan.listing, token=token)
        run["resumed_bytes"] = _fetch_shards(plan, reader, partial, progress)
        run["fetch"] = reader.stats.to_json()

    def check() -> dict:
        _check_output(partial, plan)
        pinned.unlink()
        return {}

    write_output(
        output,
        tx,
        OutputJob(command=command, produce=produce, check=check, extra=lambda: {"download": report, RUN: run}),
    )
    return {**report, **run}


def _fetch_shards(plan: FetchPlan, reader: RangeReader, partial: Path, progress: bool) -> int:
    """Every planned shard into `partial` (a `.part` file continued where it stopped, renamed when
    complete); returns the bytes found already there."""
    bar = _bar(progress, plan.data_bytes)
    resumed = 0
    for s in plan.shards:
        final = partial / s.source
        part = partial / (s.source + ".part")
        want = len(s.header) + s.data_bytes
        if final.exists() and final.stat().st_size == want and _head_matches(final, s.header):
            resumed += s.data_bytes
            bar.update(s.data_bytes)
        else:
            resumed += _fill_part(reader, s, part, bar)
            size = part.stat().st_size
            if size != want:
                raise VerificationError("fetched shard has the wrong size", path=part, expected=want, got=size)
            os.replace(part, final)
    bar.close()
    return resumed


def _head_matches(path: Path, header: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(header)) == header


def _fill_part(reader: RangeReader, s: ShardFetch, part: Path, bar) -> int:
    """Append the shard's runs to `part` starting where it stopped; returns bytes found already there."""
    hlen = len(s.header)
    if part.exists() and part.stat().st_size >= hlen and _head_matches(part, s.header):
        have = part.stat().st_size - hlen
    else:
        with open(part, "wb") as f:
            f.write(s.header)
        have = 0
    have = min(have, s.data_bytes)
    already = have
    bar.update(have)
    with open(part, "r+b") as f:
        f.truncate(hlen + have)
        f.seek(hlen + have)
        done = 0
        for a, b in s.runs:
            n = b - a
            if done + n <= have:
                done += n
                continue
            skip = max(0, have - done)

            def sink(chunk: bytes) -> None:
                f.write(chunk)
                bar.update(len(chunk))

            reader.read(s.source, a + skip, b, sink)
            done += n
        f.flush()
        os.fsync(f.fileno())
    return already


def _check_output(partial: Path, plan: FetchPlan) -> None:
    """The written shards parse and every tensor's byte length is the remote header's."""
    ckpt = Checkpoint.open(partial)
    for s in plan.shards:
        for t in s.tensors:
            got = ckpt.tensors.get(t.name)
            if got is None or got.nbytes != t.nbytes or got.dtype != t.dtype or got.shape != t.shape:
                raise VerificationError(
                    "fetched tensor does not match the remote header",
                    path=s.source,
                    tensor=t.name,
                    expected=f"{t.dtype}{list(t.shape)} {t.nbytes} B",
                    got=None if got is None else f"{got.dtype}{list(got.shape)} {got.nbytes} B",
                )


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(progress: bool, total: int):
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tensors")
