#!/usr/bin/env python
"""How long the streamed jobs plan at the real 397B's tensor count, before any layer is read.

    python benchmarks/bench_plan_397b.py --workdir /tmp/plan397 [--rounds 3] [--jobs quantize,calibrate-kv,eval-kld]
        [--executing [--device cuda]] [--end]

The layer benches (benchmarks/bench_real_layers.py) run 2-3 real-size layers, so a plan's per-tensor work is
20-30x smaller there than for the 60-layer model: quantize of the 397B plans 372k output tensors (every
routed expert's NVFP4 weight and scales). This bench builds sparse real-scale checkpoints (real headers,
holes for data: benchmarks/make_sparse_397b.py's builder; ~1 MB of disk each) and times, each in a fresh
process, the plan of each job (`--dry-run --json`: the same plan an executing run makes first), against a
baseline in the same run: a process that imports what every job imports (torch and qtool's CLI) and
plans nothing. Prints the median wall and CPU time (user + system, the child's own: steadier than the wall
on a busy machine) of each, and the plan's own seconds (each less the baseline's).

`--end` times the other end of an executing quantize: what a user waits for after the 397B's last layer is
written (the index, configs and side files, the check that every shard is the one planned, the output's
checks, the manifest, the commit). The layers are stand-ins that write each planned layer shard at once
as its header and holes (1.0 in every float32 scalar: the scales the checks read) and hand the writer a
digest, so no 233 GB is coded, written or hashed; the source's digests are recorded in the cache dir
first, as a download or an earlier run leaves them. Prints the seconds from the last layer's shard to the
process's end, and the end's parts.

`--executing` times, instead of the dry run, an executing job up to its first layer: what a user waits for
before the 397B's first layer starts (an executing run also hashes its plan for the journal, identifies
its inputs, makes the output directory, starts copying the carried-over shards and embeds the calibration
tokens). Each run ends itself at the first `LayerStreamer.load_layer` call once it has the layer's bytes
(read ahead since the job's start, or read there), and is told the disk has room for the output (the
sparse checkpoint's real output would be 233 GB; nothing past the early shards is written). Prints the
seconds from the spawn to that call ("at load") and to the layer's bytes in hand ("read": the process's
wall). The sparse layer's bytes are holes: a read as fast as the kernel hands out zeros, hashed (the
input's sha256 from the job's reads) on the same cores, so on a 2-core machine the read and its hash
slow the plan they overlap.

The runs use a cache dir of their own (`WORKDIR/cache`), filled by one untimed round first (the token ids,
transformers' package map), as a user's second run finds it. A dry run does not begin the background
import of transformers' decoder module (qtool.stream.warm_import) that an executing run's plan shares the
interpreter with, so an executing run's plan takes longer than this where the two contend for the GIL.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SOURCES = {"quantize": "bf16", "calibrate-kv": "nvfp4", "eval-kld": "nvfp4"}
JOBS = {
    "quantize": lambda w: ["quantize", str(w / "bf16"), "-o", str(w / "out-q"), "--recipe", "qwen35-nvfp4-experts"],
    "calibrate-kv": lambda w: ["calibrate-kv", str(w / "nvfp4"), "-o", str(w / "out-c"), "--replace-scales"],
    "eval-kld": lambda w: ["eval", "kld", "--ref", str(w / "nvfp4"), "--save-ref", str(w / "out-k")],
}
BASELINE = "import torch, qtool.cli.main"
# an executing job, ended at its first layer (see --executing)
UNTIL_FIRST_LAYER = """
import os, sys, time
import qtool.io.apply
from qtool.stream.layer_stream import LayerStreamer

for owner, name in ((qtool.io.apply, "free_space"), (LayerStreamer, "load_layer")):
    if not callable(getattr(owner, name, None)):  # renamed: the job would run its 397B layers for real
        raise SystemExit(f"bench_plan_397b: {owner.__name__}.{name} is gone; update UNTIL_FIRST_LAYER")
qtool.io.apply.free_space = lambda path: 1 << 60

def first_layer(self, idx, *args, **kwargs):
    print("MARK load", time.time(), file=sys.stderr, flush=True)
    if self._reader.take(idx) is None:  # not read ahead: read here, as load_layer would
        from qtool.stream.dequant import layer_tensors
        self._reader.read_now(layer_tensors(self.model_map, idx))
    print("MARK read", time.time(), file=sys.stderr, flush=True)
    os._exit(0)

LayerStreamer.load_layer = first_layer
from qtool.cli.main import console

sys.argv = ["qtool", *sys.argv[1:]]
console()
"""

# an executing quantize whose layers are stand-ins (see --end); prints the end's seconds and its parts
AFTER_LAST_LAYER = """
import atexit, os, struct, sys, threading, time
import qtool.arch.model_map, qtool.io.apply, qtool.io.checkpoint, qtool.io.manifest, qtool.io.output
import qtool.ops.checks, qtool.ops.inspect
import qtool.ops.quantize.execute
execute = sys.modules["qtool.ops.quantize.execute"]  # the package's `execute` is the function of that name
from qtool.io.plan import Produced, tensors_of
from qtool.io.writer import build_header

parts, clock = {}, {}
def timed(owner, name):
    fn = getattr(owner, name, None)
    if not callable(fn):  # a part of another tree's code (compare two trees' ends): not timed
        return
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if "last_layer" in clock:  # the end's part (the carried-over shards' writer calls some before)
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)

for owner, name in ((qtool.io.apply, "_write_shards"), (qtool.io.apply, "_check_produced"),
                    (qtool.io.apply, "check_written"), (getattr(qtool.ops.checks, "PlannedProblems", None), "result"),
                    (qtool.io.checkpoint.Checkpoint, "open"), (qtool.arch.model_map, "build_map"),
                    (qtool.ops.inspect, "find_problems"),
                    (qtool.io.manifest.InputHasher, "results"), (qtool.io.apply, "_manifest"),
                    (qtool.io.output.OutputDir, "commit"), (qtool.io.apply, "_remember_digests")):
    timed(owner, name)
qtool.io.apply.free_space = lambda path: 1 << 60
hashers = []
_init = qtool.io.manifest.InputHasher.__init__
def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    hashers.append(self)
qtool.io.manifest.InputHasher.__init__ = init

def layers(p, partial, ids, streamer, *, resume, progress=None, mode=0o644, shards=None, prefetched=None):
    streamer.close()  # the first layer's read begun at the start: a real job's reads are over at its end
    entries = {e.name: e for e in p.output.entries(Produced)}
    for lp in p.layers:
        e = entries[lp.shard]
        tensors = tensors_of(e)
        offset = len(head := build_header(tensors, e.metadata))
        fd = os.open(partial / lp.shard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, head)
            for t in tensors:
                if t.dtype == "F32" and t.source.nbytes == 4:
                    os.pwrite(fd, struct.pack("<f", 1.0), offset)
                offset += t.source.nbytes
            os.ftruncate(fd, offset)
        finally:
            os.close(fd)
        shards.finished(lp.shard, "0" * 64)
    for t in threading.enumerate():  # the carried-over shards, long written by a real 60-layer job's end
        if t.name == "qtool-early-shards":
            t.join()
    for f in [f for h in hashers for f in h.futures.values()]:  # and hashed
        f.result()
    clock["last_layer"] = time.perf_counter()
    entry = {"tokens_per_expert": [1], "experts_without_tokens": [], "expert_tokens": "natural",
             "min_expert_tokens": 1, "fallback_rule": "layer_amax", "experts_fallback": []}
    return {"layers": [{"layer": lp.index, "routed_experts": lp.scheme.value, **entry} for lp in p.layers],
            "seconds": 0.0}

execute.calibrate_and_write = layers
def report():
    if "last_layer" in clock:
        end = time.perf_counter() - clock["last_layer"]
        rest = end - sum(parts.values())
        print("END", end, " ".join(f"{k}={v:.2f}" for k, v in [*parts.items(), ("rest", rest)]), file=sys.stderr)
atexit.register(report)
from qtool.cli.main import console

sys.argv = ["qtool", *sys.argv[1:]]
console()
"""


def record_source_digests(workdir: Path, source: Path) -> None:
    """The source's sha256 in the cache dir, as a download or an earlier run records them (the sparse
    shards' real digests would take reading 800 GB of holes; the value is never compared here)."""
    from qtool.io.digest_cache import DigestCache

    cache = DigestCache(workdir / "cache" / "sha256-cache.json")
    for f in sorted(source.iterdir()):
        if f.is_file():
            cache.record(os.path.realpath(f), "0" * 64, f.stat().st_size)
    cache.save()


def fill_first_layer(source: Path) -> None:
    """Layer 0's bytes written as data (random 64 MB blocks), once (a marker file says so)."""
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.stream.dequant import layer_tensors

    marker = source.parent / f".{source.name}-first-layer-data"
    if marker.exists():
        return
    mm = build_map(Checkpoint.open(source, require_config=True), read_values=False)
    block = os.urandom(64 << 20)
    fds: dict[str, int] = {}
    try:
        for info in layer_tensors(mm, 0):
            fd = fds.setdefault(info.file, os.open(info.file, os.O_WRONLY))
            for off in range(info.start, info.end, len(block)):
                os.pwrite(fd, block[: min(len(block), info.end - off)], off)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    marker.touch()


def build(workdir: Path, jobs: list[str]) -> None:
    from qtool.fixtures.sparse import build_sparse
    from qtool.fixtures.tokenizer import save_tokenizer_files

    for name, flavour in (("bf16", "bf16-fused"), ("nvfp4", "modelopt-nvfp4")):
        if name not in {SOURCES[j] for j in jobs}:
            continue
        out = workdir / name
        if not (out / "model.safetensors.index.json").exists():
            build_sparse(out, model="397b", flavour=flavour)
            save_tokenizer_files(out)


ENV: dict[str, str] = dict(os.environ)


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def timed(argv: list[str]) -> tuple[float, float, dict[str, float]]:
    """(wall, CPU) seconds of one run of `argv` in a fresh process, and the seconds from its spawn to each
    `MARK name EPOCH` line it printed on stderr."""
    c, t, t_epoch = _children_cpu(), time.perf_counter(), time.time()
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    wall, cpu = time.perf_counter() - t, _children_cpu() - c
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    marks = {x.split()[1]: float(x.split()[2]) - t_epoch for x in r.stderr.splitlines() if x.startswith("MARK ")}
    return wall, cpu, marks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument(
        "--executing", action="store_true", help="time an executing job up to its first layer instead of the dry run"
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="--executing: the jobs' device (cuda: the first layer is read through pinned staging "
        "buffers to the GPU, as a user's job reads it; cpu: into fresh host memory)",
    )
    ap.add_argument(
        "--evict-input",
        action="store_true",
        help="--executing: the job's input evicted from the page cache before each run "
        "(posix_fadvise DONTNEED): the first layer read from the disk, where its bytes are "
        "data, not holes",
    )
    ap.add_argument(
        "--first-layer-data",
        action="store_true",
        help="--executing: the sources' first decoder layer written as data (13 GB each, once), "
        "not holes: with --evict-input its read is the disk's",
    )
    ap.add_argument(
        "--cache-filled",
        action="store_true",
        help="an earlier run of this bench filled WORKDIR/cache: no untimed round first",
    )
    ap.add_argument(
        "--end", action="store_true", help="time an executing quantize after its last layer (stand-in layers) instead"
    )
    args = ap.parse_args(argv)
    jobs = ["quantize"] if args.end else [j for j in args.jobs.split(",") if j]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        raise SystemExit(f"unknown job(s) {unknown}: choose from {sorted(JOBS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    build(args.workdir, jobs)
    ENV["QTOOL_CACHE_DIR"] = str(args.workdir / "cache")
    if args.first_layer_data:
        for source in sorted({SOURCES[j] for j in jobs}):
            fill_first_layer(args.workdir / source)
            record_source_digests(args.workdir, args.workdir / source)  # (its files changed: on record again)
    if args.end:
        return end_rounds(args)
    runs: dict[str, list[tuple[float, float, dict]]] = {"baseline": []} | {j: [] for j in jobs}
    first_round = 1 if args.cache_filled else 0  # round 0 (untimed) fills the cache dir
    for k in range(first_round, args.rounds + 1):  # interleaved: a slower moment of the machine hits every row
        for name in runs:
            if name == "baseline":
                argv = [sys.executable, "-c", BASELINE]
            elif args.executing:
                for out in args.workdir.glob("out-*"):  # a fresh output each run, as a user's first
                    shutil.rmtree(out)
                if args.evict_input:  # (its next read comes from the disk)
                    from qtool.fixtures.page_cache import evict

                    evict(f for f in sorted((args.workdir / SOURCES[name]).iterdir()) if f.is_file())
                few = ["--windows", "1"] if name == "eval-kld" else ["--samples", "1"]  # a small calibration set
                argv = [
                    sys.executable,
                    "-c",
                    UNTIL_FIRST_LAYER,
                    *JOBS[name](args.workdir),
                    *few,
                    "--seq-len",
                    "16",
                    "--device",
                    args.device,
                ]
            else:
                argv = [sys.executable, "-m", "qtool", *JOBS[name](args.workdir), "--dry-run", "--json"]
            t = timed(argv)
            if k > 0:  # round 0 fills the cache dir
                runs[name].append(t)
    if args.rounds == 0:
        return 0  # (the cache dir filled, for --cache-filled runs)

    def median(name: str, k: int) -> float:
        return statistics.median(r[k] for r in runs[name])

    if args.executing:
        print(f"{'run':<14} {'at load':>8} {'read':>8} {'CPU':>8}   rounds (at load / read / CPU)")
        for name, rs in runs.items():
            if name == "baseline":
                print(f"{name:<14} {median(name, 0):6.2f} s {'-':>8} {median(name, 1):6.2f} s")
                continue
            at = [r[2]["load"] for r in rs]
            print(
                f"{name:<14} {statistics.median(at):6.2f} s {median(name, 0):6.2f} s {median(name, 1):6.2f} s   "
                + " ".join(f"{a:.2f}/{w:.2f}/{c:.2f}" for a, (w, c, _) in zip(at, rs, strict=True))
            )
        return 0
    print(f"{'run':<14} {'wall':>8} {'CPU':>8} {'plan: wall':>11} {'plan: CPU':>10}   rounds (wall / CPU)")
    for name, rs in runs.items():
        wall, cpu = median(name, 0), median(name, 1)
        plan = (
            ("-", "-")
            if name == "baseline"
            else (f"{wall - median('baseline', 0):.2f} s", f"{cpu - median('baseline', 1):.2f} s")
        )
        print(
            f"{name:<14} {wall:6.2f} s {cpu:6.2f} s {plan[0]:>11} {plan[1]:>10}   "
            + " ".join(f"{w:.2f}/{c:.2f}" for w, c, _ in rs)
        )
    return 0


def end_rounds(args) -> int:
    """--end: each round a fresh output; the seconds after the last layer and their parts, each round's."""
    record_source_digests(args.workdir, args.workdir / SOURCES["quantize"])
    print(f"{'round':<6} {'end':>7}   parts (s)")
    ends = []
    for k in range(args.rounds):
        for out in args.workdir.glob("out-*"):
            shutil.rmtree(out)
        argv = [
            sys.executable,
            "-c",
            AFTER_LAST_LAYER,
            *JOBS["quantize"](args.workdir),
            "--samples",
            "1",
            "--seq-len",
            "16",
        ]
        r = subprocess.run(argv, capture_output=True, text=True, env=ENV)
        line = next((x for x in r.stderr.splitlines() if x.startswith("END ")), None)
        if r.returncode != 0 or line is None:
            raise SystemExit(f"{' '.join(argv[:2])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
        _, end, *parts = line.split()
        ends.append(float(end))
        print(f"{k:<6} {float(end):5.2f} s   {' '.join(parts)}")
    print(f"median {statistics.median(ends):5.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
