"""Execute a hybrid plan: link unchanged shards, rebuild changed ones from byte ranges, write configs and
index, check, write the manifest, and move `<out>.partial/` into place.

Resume: `<out>.partial/.qtool-journal.jsonl` starts with the plan hash; one line per finished shard is
appended only after the shard file itself was fsynced. `--resume` skips the shards the
journal lists (size re-checked) and redoes the rest; a journal with another plan hash is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qtool.arch.model_map import build_map
from qtool.errors import WriteError
from qtool.io.atomic_dir import commit_output, fsync_dir, partial_path, prepare_output
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.jsonio import dumps
from qtool.io.writer import write_index_json, write_shard
from qtool.ops.assemble.linking import Linker
from qtool.ops.assemble.plan import JOURNAL_NAME, MANIFEST_NAME, HybridPlan, PlannedShard, ShardAction
from qtool.ops.checks import (
    Expectations,
    consistency_problems,
    finish_checks,
    hybrid_expectations,
    start_checks,
)
from qtool.ops.manifest import InputHasher, write_manifest, write_shards_section

# Test hook: called with the shard name after each shard is journaled (raise to simulate a crash).
after_shard: Callable[[str], None] | None = None
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


class Journal:
    def __init__(self, path: Path, plan_hash: str, resume: bool) -> None:
        self.path = path
        self.done: dict[str, int] = {}
        if resume and path.exists():
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
            if head.get("plan_hash") != plan_hash:
                raise WriteError(
                    "cannot resume: the unfinished output was started with a different plan",
                    path=path.parent,
                    expected=f"plan {plan_hash[:16]}",
                    got=f"plan {str(head.get('plan_hash'))[:16]}",
                    hint="run the same command as before (same sources, options and inputs), or drop "
                    "--resume to start over",
                )
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break  # a torn last line: that shard is redone
                self.done[rec["shard"]] = rec["size"]
        else:
            self._write_line({"plan_hash": plan_hash}, mode="w")

    def _write_line(self, obj: dict, mode: str = "a") -> None:
        # No fsync here: a shard is recorded only after its own fsync, so a journal line that reaches the
        # disk always describes a durable shard, and a line lost in a crash only means that shard is redone
        # (is_done also checks the file's size). Syncing the journal cost ~0.1 s per shard on ext4.
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    def is_done(self, partial: Path, name: str) -> bool:
        size = self.done.get(name)
        p = partial / name
        return size is not None and p.exists() and p.stat().st_size == size

    def record(self, name: str, size: int) -> None:
        self._write_line({"shard": name, "size": size})
        self.done[name] = size


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


def _place_shard(s: PlannedShard, dst: Path, size: int, linker: Linker, headers: _Countdown,
                 stop: threading.Event) -> str | None:
    """Write or link one shard of `size` bytes and make it durable; returns the link method, None when
    written. Tells `headers` as soon as the shard's header is on disk, so the header-only checks can
    run while the data is still being copied."""
    if s.action is ShardAction.LINK:
        method = linker.place(s.source_file, str(dst))  # durable on return
        headers.one()
        return method
    if any(t.origin.slice for t in s.tensors):
        # only unfusing reads alternate between two regions of a file; plain runs read sequentially and
        # the kernel's own readahead does better without our hints (shared-experts-only job, 4 interleaved
        # runs: 4.90-6.32 s without vs 5.49-6.43 s with, `cp -r` + sync 3.36-4.24 s)
        _prefetch(s)
    got = write_shard(dst, s.out_tensors(), s.metadata, on_header=headers.one, stop=stop)  # fsynced
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


def _check_space(plan: HybridPlan, partial: Path, linker: Linker, journal: Journal) -> None:
    need = 0
    for s in plan.shards:
        if journal.is_done(partial, s.name):
            continue
        if s.action is ShardAction.LINK:
            if linker.expect_new_bytes(s.source_file, str(partial)):
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


def _copy_extra(plan: HybridPlan, partial: Path) -> None:
    for rel in plan.extra_files:
        dst = partial / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel == CONFIG_NAME and plan.config is not None:
            _write_text(dst, dumps(plan.config, plan.nv.config_style))
        elif rel == HF_QUANT_CONFIG_NAME and plan.hf_quant_config is not None:
            _write_text(dst, dumps(plan.hf_quant_config, plan.nv.hf_quant_style))
        else:
            shutil.copyfile(plan.nv.root / rel, dst)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _work_without_shard_bytes(plan: HybridPlan, partial: Path, section: Path, roots: dict[str, Path]
                              ) -> Expectations:
    """What the main thread does while the writers copy: side files, index, the manifest's tensor list;
    then it takes what the checks need of the sources (the promised layout) and drops the sources' headers
    before the checks read the output's (two 397B header sets at once: ~1 GB)."""
    _copy_extra(plan, partial)
    total = sum(s.data_bytes for s in plan.shards)
    write_index_json(partial / INDEX_NAME, plan.weight_map(), total)
    write_shards_section(section, plan.shards, roots)
    expect = hybrid_expectations(plan)
    plan.release_source_headers()
    return expect


def _source_problems(plan: HybridPlan) -> list[str]:
    """The NVFP4 source's own consistency problems (reported as inherited, not failures). Only needed when
    the output has problems, so its headers are read again then rather than kept: the check reads scale
    values, which from a source the writers keep the disk busy on took seconds."""
    return consistency_problems(build_map(Checkpoint.open(plan.nv.root)))


def _fsync_side_files(plan: HybridPlan, partial: Path) -> None:
    """Make the configs, index and other small files durable. Done once the shards are written: an fsync
    issued while the shard writers keep the disk busy waits behind them (0.5 s for a few KB)."""
    for rel in [*plan.extra_files, INDEX_NAME]:
        fd = os.open(partial / rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def execute(plan: HybridPlan, *, force: bool = False, resume: bool = False, command: str | None = None,
            progress: bool = False) -> RunResult:
    opts = plan.options
    out = Path(opts.out)
    if resume and out.exists() and not partial_path(out).exists() and not force:
        raise WriteError("nothing to resume: the output is already complete", path=out,
                         hint="remove it or pass --force to build it again")
    partial = prepare_output(out, force=force, resume=resume)
    plan_hash = plan.plan_hash()
    journal = Journal(partial / JOURNAL_NAME, plan_hash, resume)
    # set when the run fails or is interrupted: the shards in flight stop within a chunk instead of being
    # finished (four 5 GB shards would otherwise delay Ctrl-C by a minute); they are redone on --resume
    stop = threading.Event()
    linker = Linker(opts.link, stop)
    _check_space(plan, partial, linker, journal)

    hasher = InputHasher()
    result = RunResult(out, plan_hash)
    roots = {"nvfp4": plan.nv.root, "bf16": plan.bf.root}
    section = partial / SHARDS_SECTION_NAME
    try:
        for f in plan.input_files():
            hasher.submit(f)
        for rel in plan.extra_files:
            hasher.submit(str(plan.nv.root / rel))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(plan.shard_bytes(s) for s in plan.shards), unit="B", unit_scale=True,
                       desc="assemble", leave=False)
        kill_after = int(os.environ.get("QTOOL_TEST_KILL_AFTER_SHARDS", "0") or 0)
        todo = []
        for s in plan.shards:
            if journal.is_done(partial, s.name):
                result.shards_resumed += 1
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
        # Only journaled shards count as done, so a crash redoes the ones in flight.
        with ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="qtool-shard") as pool:
            # Largest first: a big shard (e.g. a new one holding a grafted MTP head) started last would
            # finish alone, long after the others; unchanged ones before all (cheap when linked, and a
            # copied one counts as having a header only once placed).
            order = sorted(todo, key=lambda s: (s.action is not ShardAction.LINK, -plan.shard_bytes(s)))
            futures = [(s, pool.submit(_place_shard, s, partial / s.name, plan.shard_bytes(s), linker, headers,
                                       stop)) for s in order]
            try:
                expect = _work_without_shard_bytes(plan, partial, section, roots)
                for s, fut in futures:
                    while started is None and not fut.done():
                        if headers.done.wait(0.05):
                            plan.release_tensors()  # every writer has its tensor list by now
                            started = start_checks(partial, expect, shards_complete=False)
                    method = fut.result()
                    if method is None:
                        result.shards_written += 1
                    else:
                        result.shards_linked[method] = result.shards_linked.get(method, 0) + 1
                    size = plan.shard_bytes(s)
                    journal.record(s.name, size)
                    if after_shard is not None:
                        after_shard(s.name)
                    if kill_after and result.shards_written + sum(result.shards_linked.values()) >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
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
        _fsync_side_files(plan, partial)
        result.checks = checks
        digests = hasher.results()
    except BaseException:
        hasher.close()
        raise
    sources = {
        "nvfp4": {"path": str(plan.nv.root), "files": {}},
        "bf16": {"path": str(plan.bf.root), "files": {}},
    }
    for f, d in digests.items():
        key = "nvfp4" if Path(f).is_relative_to(plan.nv.root) else "bf16"
        sources[key]["files"][os.path.relpath(f, sources[key]["path"])] = {"sha256": d,
                                                                           "bytes": os.path.getsize(f)}
    write_manifest(partial / MANIFEST_NAME, kind="assemble hybrid", command=command, sources=sources,
                   shards_section=section, summary={**plan.summary(), "plan_hash": plan_hash}, checks=checks)
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
    commit_output(partial, out)
    return result
