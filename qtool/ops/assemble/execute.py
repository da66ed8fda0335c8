"""Execute a hybrid plan: its shards, configs and index as an output plan (qtool.io.plan), run by the
shared executor (qtool.io.apply: the lock, the journal, the writer threads, the manifest, the commit)
inside qtool.io.output.OutputDir; assemble adds the header-only checks that run while shard data is
still being copied, and the manifest's tensor-origin section.

Resume: `<out>.partial/.qtool-journal.jsonl` starts with the plan hash and the inputs' identity; one line
per finished shard is appended only after the shard file itself was fsynced. `--resume` skips the shards
the journal lists (size re-checked) and redoes the rest; another plan or a changed input is refused.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.model_map import build_map
from qtool.io.apply import OutputJob, free_space, write_output  # noqa: F401 (free_space: re-exported)
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, INDEX_NAME, Checkpoint
from qtool.io.manifest import write_shards_section
from qtool.io.output import OutputDir
from qtool.io.plan import Copy, Index, Json, Link, OutputPlan, Shard
from qtool.ops.assemble.model import HybridPlan, PlannedShard, ShardAction
from qtool.ops.checks import consistency_problems, finish_checks, hybrid_expectations, start_checks

SHARDS_SECTION_NAME = ".qtool-manifest-shards.part"  # the manifest's tensor list, written during the copy


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


def _tensors_of(s: PlannedShard):
    """The shard's tensor list, made when its writer starts (and the source ranges prefetched when the
    shard unfuses experts)."""

    def make():
        if any(t.origin.slice for t in s.added):
            # only unfusing reads alternate between two regions of a file; plain runs read sequentially and
            # the kernel's own readahead does better without our hints (shared-experts-only job, 4
            # interleaved runs: 4.90-6.32 s without vs 5.49-6.43 s with, `cp -r` + sync 3.36-4.24 s)
            _prefetch(s)
        return s.out_tensors()

    return make


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


def output_plan(plan: HybridPlan) -> OutputPlan:
    """The hybrid as data: linked and rebuilt shards, the configs (in the NVFP4 source's own formatting),
    the other side files, the index."""
    files: list = []
    for s in plan.shards:
        if s.action is ShardAction.LINK:
            files.append(Link(s.name, s.source_file))
        else:
            files.append(Shard(s.name, _tensors_of(s), s.metadata, size=plan.shard_bytes(s)))
    for rel in plan.extra_files:
        if rel == CONFIG_NAME and plan.config is not None:
            files.append(Json(rel, plan.config, plan.nv.config_style))
        elif rel == HF_QUANT_CONFIG_NAME and plan.hf_quant_config is not None:
            files.append(Json(rel, plan.hf_quant_config, plan.nv.hf_quant_style))
        else:
            files.append(Copy(rel, str(plan.nv.root / rel)))
    files.append(Index(INDEX_NAME, plan.weight_map, {"total_size": sum(s.data_bytes for s in plan.shards)}))
    plan_hash = plan.plan_hash()
    return OutputPlan(
        "assemble hybrid",
        files,
        sources={"nvfp4": plan.nv.root, "bf16": plan.bf.root},
        inputs=[*plan.input_files(), *(str(plan.nv.root / rel) for rel in plan.extra_files)],
        taken=plan.taken_ranges(),
        summary={**plan.summary(), "plan_hash": plan_hash},
        hash=plan_hash,
    )


def execute(plan: HybridPlan, *, progress: bool = False) -> RunResult:
    opts = plan.options
    # set when the run fails or is interrupted: the shards in flight stop within a chunk instead of being
    # finished (four 5 GB shards would otherwise delay Ctrl-C by a minute); they are redone on --resume
    stop = threading.Event()
    output = output_plan(plan)
    roots = {"nvfp4": plan.nv.root, "bf16": plan.bf.root}
    state: dict = {}
    with OutputDir(
        opts.out, sources=[plan.nv.root, plan.bf.root], force=opts.force, resume=opts.resume, link=opts.link, stop=stop
    ) as tx:
        section = tx.partial / SHARDS_SECTION_NAME

        def overlap() -> None:
            # while the writers copy: the manifest's tensor list, and what the checks need of the sources
            # (the promised layout); then the sources' headers are dropped before the checks read the
            # output's (two 397B header sets at once: ~1 GB)
            write_shards_section(section, plan.shards, roots)
            state["expect"] = hybrid_expectations(plan)
            plan.release_source_headers()

        def on_headers() -> None:
            # every shard's header is on disk: the header-only checks run while the data is copied
            plan.release_tensors()  # every writer has its tensor list by now
            state["started"] = start_checks(tx.partial, state["expect"], shards_complete=False)

        def check() -> dict:
            checks = finish_checks(
                state["started"], lambda: consistency_problems(build_map(Checkpoint.open(plan.nv.root)))
            )
            failed = [c for c in checks["checks"] if not c["ok"]]
            checks["summary"] = "; ".join(f"{c['name']}: {c['problems'][0]}" for c in failed) or None
            return checks

        applied = write_output(
            output,
            tx,
            OutputJob(
                command=opts.command,
                overlap=overlap,
                on_headers=on_headers,
                check=check,
                shards_section=section,
                progress=progress,
                stop=stop,
            ),
        )
    return RunResult(
        tx.out, applied.plan_hash, len(applied.written), applied.linked, len(applied.resumed), applied.checks
    )
