"""Execute a hybrid plan: link unchanged shards, rebuild changed ones from byte ranges, write configs and
index, check, write the manifest, and move `<out>.partial/` into place (qtool.io.output.OutputDir: the
lock, the overlap and --force rules, the journal).

Resume: `<out>.partial/.qtool-journal.jsonl` starts with the plan hash and the inputs' identity; one line
per finished shard is appended only after the shard file itself was fsynced. `--resume` skips the shards
the journal lists (size re-checked) and redoes the rest; another plan or a changed input is refused.
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.model_map import build_map
from qtool.errors import WriteError
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import dumps
from qtool.io.files import fsync_dir, new_file, Placer
from qtool.io.identity import input_identity, Journal
from qtool.io.output import OutputDir
from qtool.io.writer import index_text, write_shard
from qtool.ops.assemble.model import JOURNAL_NAME, MANIFEST_NAME, HybridPlan, PlannedShard, ShardAction
from qtool.ops.checks import (
    Expectations,
    consistency_problems,
    finish_checks,
    hybrid_expectations,
    start_checks,
)
from qtool.io.manifest import InputHasher, source_entry, write_manifest, write_shards_section

SPACE_MARGIN = 64 << 20
WRITERS = 4  # shards in flight (see execute)
SHARDS_SECTION_NAME = ".qtool-manifest-shards.part"  # the manifest's tensor list, written during the copy


def free_space(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (a function so tests can monkeypatch it)."""
    return shutil.disk_usage(path).free


@dataclass
class RunResult:
    out: Path
    plan_hash: str
    shards_written: int = 0
    shards_linked: dict[str, int] = field(default_factory=dict)
    shards_resumed: int = 0
    checks: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "out": str(self.out),
            "plan_hash": self.plan_hash,
            "shards_written": self.shards_written,
            "shards_linked": self.shards_linked,
            "shards_resumed": self.shards_resumed,
            "checks": self.checks,
        }


class _Countdown:
    """Set once `n` shards have their header on disk (their data may still be being written)."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.lock = threading.Lock()
        self.done = threading.Event()
        if n == 0:
            self.done.set()

    def one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()


def _place_shard(s: PlannedShard, dst: Path, size: int, placer: Placer, headers: _Countdown,
                 stop: threading.Event) -> str | None:
    """Write or link one shard of `size` bytes and make it durable; returns the link method, None when
    written. Tells `headers` as soon as the shard's header is on disk, so the header-only checks can
    run while the data is still being copied."""
    if s.action is ShardAction.LINK:
        method = placer.place(s.source_file, dst)  # durable on return
        headers.one()
        return method
    if any(t.origin.slice for t in s.tensors):
        # only unfusing reads alternate between two regions of a file; plain runs read sequentially and
        # the kernel's own readahead does better without our hints (shared-experts-only job, 4 interleaved
        # runs: 4.90-6.32 s without vs 5.49-6.43 s with, `cp -r` + sync 3.36-4.24 s)
        _prefetch(s)
    got = write_shard(dst, s.out_tensors(), s.metadata, on_header=headers.one, stop=stop,
                      mode=placer.file_mode)  # fsynced
    if got != size:
        raise WriteError("a written shard does not have its planned size (a qtool bug)", path=dst,
                         expected=f"{size} bytes", got=f"{got} bytes")
    return None


PREFETCH_CHUNK = 8 << 20


def _prefetch(s: PlannedShard) -> None:
    """Ask the kernel to read the shard's source byte ranges ahead (POSIX_FADV_WILLNEED: asynchronous, no
    copy), each file's ranges coalesced and in file order, in chunks (the kernel clamps one WILLNEED to
    about the readahead window). Without it, tensors taken alternately from two regions of one file (the
    gate/up and down halves of fused experts being unfused) defeat the per-file readahead, and each one
    becomes a synchronous read of a few MB."""
    if not hasattr(os, "posix_fadvise"):
        return
    runs: dict[str, list[list[int]]] = {}
    for t in sorted(s.tensors, key=lambda t: (t.origin.file, t.origin.start)):
        rs = runs.setdefault(t.origin.file, [])
        if rs and t.origin.start <= rs[-1][1] + PREFETCH_CHUNK:
            rs[-1][1] = max(rs[-1][1], t.origin.end)
        else:
            rs.append([t.origin.start, t.origin.end])
    for file, rs in runs.items():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # the copy reports it
        try:
            for start, end in rs:
                for off in range(start, end, PREFETCH_CHUNK):
                    os.posix_fadvise(fd, off, min(PREFETCH_CHUNK, end - off), os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _check_space(plan: HybridPlan, partial: Path, placer: Placer, journal: Journal) -> None:
    need = 0
    for s in plan.shards:
        if journal.file_done(partial, s.name):
            continue
        if s.action is ShardAction.LINK:
            if placer.expect_new_bytes(s.source_file, partial):
                need += os.path.getsize(s.source_file)
        else:
            need += plan.shard_bytes(s)
    need += sum(os.path.getsize(plan.nv.root / f) for f in plan.extra_files)
    have = free_space(partial)
    if have < need + SPACE_MARGIN:
        raise WriteError(
            "not enough free disk space for the output",
            path=partial,
            expected=f"{need + SPACE_MARGIN} bytes free",
            got=f"{have} bytes free",
            hint="free space, choose another -o, or use --link auto/hardlink with the output on the "
            "NVFP4 source's filesystem so unchanged shards take no space",
        )


def _copy_extra(plan: HybridPlan, partial: Path, placer: Placer) -> None:
    for rel in plan.extra_files:
        dst = partial / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel == CONFIG_NAME and plan.config is not None:
            _write_text(dst, dumps(plan.config, plan.nv.config_style), placer.file_mode)
        elif rel == HF_QUANT_CONFIG_NAME and plan.hf_quant_config is not None:
            _write_text(dst, dumps(plan.hf_quant_config, plan.nv.hf_quant_style), placer.file_mode)
        else:
            _write_text(dst, None, placer.file_mode, src=plan.nv.root / rel)


def _write_text(path: Path, text: str | None, mode: int, src: Path | None = None) -> None:
    """A small side file: `text`, or a copy of `src` (never written through an existing link)."""
    with new_file(path, mode) as f:
        f.write(text.encode() if text is not None else src.read_bytes())


def _write_index(path: Path, weight_map: dict[str, str], total: int, mode: int) -> None:
    with new_file(path, mode) as f:
        for chunk in index_text(weight_map, {"total_size": total}):
            f.write(chunk.encode())


def _work_without_shard_bytes(plan: HybridPlan, partial: Path, section: Path, roots: dict[str, Path],
                              placer: Placer) -> Expectations:
    """What the main thread does while the writers copy: side files, index, the manifest's tensor list;
    then it takes what the checks need of the sources (the promised layout) and drops the sources' headers
    before the checks read the output's (two 397B header sets at once: ~1 GB)."""
    _copy_extra(plan, partial, placer)
    total = sum(s.data_bytes for s in plan.shards)
    _write_index(partial / INDEX_NAME, plan.weight_map(), total, placer.file_mode)
    write_shards_section(section, plan.shards, roots)
    expect = hybrid_expectations(plan)
    plan.release_source_headers()
    return expect


def _source_problems(plan: HybridPlan) -> list[str]:
    """The NVFP4 source's own consistency problems (reported as inherited, not failures). Only needed when
    the output has problems, so its headers are read again then rather than kept: the check reads scale
    values, which from a source the writers keep the disk busy on took seconds."""
    return consistency_problems(build_map(Checkpoint.open(plan.nv.root)))


def execute(plan: HybridPlan, *, progress: bool = False) -> RunResult:
    opts = plan.options
    force, resume, command = opts.force, opts.resume, opts.command
    # set when the run fails or is interrupted: the shards in flight stop within a chunk instead of being
    # finished (four 5 GB shards would otherwise delay Ctrl-C by a minute); they are redone on --resume
    stop = threading.Event()
    tx = OutputDir(opts.out, sources=[plan.nv.root, plan.bf.root], force=force, resume=resume,
                   link=opts.link, stop=stop)
    with tx:
        return _execute(plan, tx, stop, resume, command, progress)


def _execute(plan: HybridPlan, tx: OutputDir, stop: threading.Event, resume: bool, command: str | None,
             progress: bool) -> RunResult:
    partial, placer = tx.partial, tx.placer
    plan_hash = plan.plan_hash()
    inputs = [*plan.input_files(), *(str(plan.nv.root / rel) for rel in plan.extra_files)]
    journal = Journal(partial / JOURNAL_NAME, plan_hash, input_identity(inputs), resume)
    _check_space(plan, partial, placer, journal)

    # a resumed run re-hashes its inputs: a cached digest could predate an edit the journal missed
    hasher = InputHasher(trust_cache=not resume, record=tx.input_digests)
    result = RunResult(tx.out, plan_hash)
    roots = {"nvfp4": plan.nv.root, "bf16": plan.bf.root}
    section = partial / SHARDS_SECTION_NAME
    try:
        for f in inputs:
            hasher.submit(f)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(plan.shard_bytes(s) for s in plan.shards), unit="B", unit_scale=True,
                       desc="assemble", leave=False)
        todo = []
        for s in plan.shards:
            if journal.file_done(partial, s.name):
                result.shards_resumed += 1
                if s.action is not ShardAction.LINK:
                    hasher.submit_output(str(partial / s.name))
                if bar is not None:
                    bar.update(plan.shard_bytes(s))
            else:
                todo.append(s)
        headers = _Countdown(len(todo))
        started = None  # the header-only checks, once every shard's header is written
        # WRITERS threads write the shards; this thread journals them in queue order as they finish, and
        # meanwhile does the work that needs no shard bytes (side files, index, the manifest's tensor
        # list), then the header-only checks as soon as every shard's header is written, so all of it
        # overlaps the copy instead of following it (~10 s for a 397B checkpoint's 370k tensors).
        # Several in flight: a shard's fsync (a synchronous write-out of ~all its bytes: they stay dirty
        # below the kernel's background-writeback threshold) overlaps other shards' reads and copies, and
        # the disk sees a deeper queue (3 GB job, the copy alone, two sets of 5 interleaved runs, medians:
        # 1 writer 4.89 s, 2: 3.83 s, 3: 3.29 s, 4: 3.11 s; 2: 3.68 s, 4: 3.54 s, 6: 3.52 s, 8: 3.66 s).
        # Only journaled shards count as done, so a crash redoes the ones in flight. A written shard is
        # hashed (for the manifest's `files`) by the hasher's threads right after it is journaled, while
        # its bytes are still in the page cache.
        with ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="qtool-shard") as pool:
            # Largest first: a big shard (e.g. a new one holding a grafted MTP head) started last would
            # finish alone, long after the others; unchanged ones before all (cheap when linked, and a
            # copied one counts as having a header only once placed).
            order = sorted(todo, key=lambda s: (s.action is not ShardAction.LINK, -plan.shard_bytes(s)))
            futures = [(s, pool.submit(_place_shard, s, partial / s.name, plan.shard_bytes(s), placer, headers,
                                       stop)) for s in order]
            try:
                expect = _work_without_shard_bytes(plan, partial, section, roots, placer)
                for s, fut in futures:
                    while started is None and not fut.done():
                        if headers.done.wait(0.05):
                            plan.release_tensors()  # every writer has its tensor list by now
                            started = start_checks(partial, expect, shards_complete=False)
                    method = fut.result()
                    if method is None:
                        result.shards_written += 1
                        hasher.submit_output(str(partial / s.name))
                    else:
                        result.shards_linked[method] = result.shards_linked.get(method, 0) + 1
                    size = plan.shard_bytes(s)
                    journal.record(s.name, size=size)
                    if bar is not None:
                        bar.update(size)
            except BaseException:
                stop.set()
                for _, f in futures:
                    f.cancel()
                raise
        if bar is not None:
            bar.close()
        if started is None:  # every shard was resumed, or finished before this thread looked
            plan.release_tensors()
            started = start_checks(partial, expect)
        checks = finish_checks(started, lambda: _source_problems(plan))
        result.checks = checks
        digests = hasher.results()
    except BaseException:
        hasher.close()
        raise
    sources = {"nvfp4": source_entry(plan.nv.root, {f: d for f, d in digests.items()
                                                    if Path(f).is_relative_to(plan.nv.root)}),
               "bf16": source_entry(plan.bf.root, {f: d for f, d in digests.items()
                                                   if Path(f).is_relative_to(plan.bf.root)})}
    write_manifest(partial / MANIFEST_NAME, kind="assemble hybrid", command=command, sources=sources,
                   shards_section=section, summary={**plan.summary(), "plan_hash": plan_hash}, checks=checks,
                   files=_output_files(plan, partial, digests))
    if not checks["passed"]:
        from qtool.errors import VerificationError

        failed = [c for c in checks["checks"] if not c["ok"]]
        raise VerificationError(
            f"the assembled checkpoint failed {len(failed)} check(s); it was left in {partial}",
            path=partial,
            got="; ".join(f"{c['name']}: {c['problems'][0]}" for c in failed),
            hint="this is a qtool bug or an inconsistent source; see qtool-manifest.json there",
        )
    os.unlink(partial / JOURNAL_NAME)
    fsync_dir(partial)
    tx.commit()
    return result


def _output_files(plan: HybridPlan, partial: Path, digests: dict[str, str]) -> dict[str, dict]:
    """The manifest's `files`: a linked shard has its source file's digest, a written one the digest the
    hasher took after it was written, side files are hashed here (small)."""
    from qtool.io.output import output_files

    known = {}
    for s in plan.shards:
        src = s.source_file if s.action is ShardAction.LINK else str(partial / s.name)
        if src in digests:
            known[s.name] = digests[src]
    return output_files(partial, known, skip=(MANIFEST_NAME, SHARDS_SECTION_NAME, JOURNAL_NAME))
