#!/usr/bin/env python
"""Peak memory of qtool's metadata at the real 397B scale (366,866 tensors), on sparse checkpoints.

    python benchmarks/bench_memory_397b.py --workdir /tmp/s397mem [--layers 0] [--keep]

Builds (or reuses) the sparse real-scale pair with benchmarks/make_sparse_397b.py's builder (real headers,
holes for data: ~1 GB of disk), then measures, each in a fresh process, the peak RSS (ru_maxrss) of:
- baseline: the interpreter with qtool's CLI imported;
- `qtool inspect NVFP4 --json`;
- `qtool assemble hybrid ... --dry-run --json` (plan only);
- execute's metadata path without the copy, in one process: plan, plan hash, summary, index, the
  manifest's tensor list, expectations, the tensor lists and headers of the 4 shards a run writes at
  once, dropping the sources, then the output's checks started on
  headers only and finished (run on the NVFP4 source itself, which has the output's tensor count: the
  copy of 233 GB of holes would be real writes). The copy itself holds no tensor data
  (copy_file_range), so this is the metadata part of a real run's peak;
- a whole `execute` (threads, journal, manifest, checks) whose copies skip the sources' holes (the output
  holds exactly the sources' bytes, sparse) and without the input hashing (sha256 of ~240 GB of holes;
  two 8 MiB buffers): everything else is the real run.
The issue's target is 256 MB plus the largest tensor that must be decoded (none here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EXECUTE_METADATA = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
from qtool.ops.assemble import HybridOptions, LinkMode, plan_hybrid
from qtool.ops.checks import finish_checks, hybrid_expectations, start_checks
from qtool.io.manifest import write_shards_section
nv, bf, layers = Path(sys.argv[1]), Path(sys.argv[2]), tuple(int(x) for x in sys.argv[3].split(",") if x)
t = time.perf_counter()
plan = plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=Path(tempfile.mkdtemp()) / "out",
                                 bf16_expert_layers=layers, link=LinkMode.COPY))
plan.plan_hash()
plan.summary()
index_entries = len(plan.weight_map())
with tempfile.TemporaryDirectory() as d:
    write_shards_section(Path(d) / "section", plan.shards, {"nvfp4": nv, "bf16": bf})
expect = hybrid_expectations(plan)
# what the WRITERS shards in flight hold while the checks run: their tensor lists and built headers
from qtool.io.writer import build_header
from qtool.io.apply import WRITERS
largest = sorted(plan.shards, key=lambda s: -s.num_tensors)[:WRITERS]
in_flight = [(ts, build_header(ts, s.metadata)) for s in largest for ts in [s.out_tensors()]]
plan.release_tensors()
started = start_checks(nv, expect, shards_complete=False)
del in_flight
checks = finish_checks(started)
print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "tensors": index_entries,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""

EXECUTE_SPARSE = r"""
import json, os, resource, sys, time
from pathlib import Path
import importlib
import qtool.io.files as files
import qtool.io.writer as writer
from qtool.ops.assemble import HybridOptions, LinkMode, plan_hybrid
ex = importlib.import_module("qtool.ops.assemble.execute")  # the package exports a function of that name
apply = importlib.import_module("qtool.io.apply")  # the shared executor
real_copy = files.copy_range
def sparse_copy(src_fd, dst_fd, start, count, stop=None):
    # copies the source range's data extents and leaves its holes as holes (SEEK_DATA / SEEK_HOLE): the
    # output gets exactly the sources' bytes without writing 233 GB of zeros, which this disk lacks
    base = os.lseek(dst_fd, 0, os.SEEK_CUR)
    end, off = start + count, start
    while off < end:
        try:
            data = os.lseek(src_fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole after off
            break
        if data >= end:
            break
        hole = min(os.lseek(src_fd, data, os.SEEK_HOLE), end)
        os.lseek(dst_fd, base + data - start, os.SEEK_SET)
        real_copy(src_fd, dst_fd, data, hole - data, stop)
        off = hole
    os.lseek(dst_fd, base + count, os.SEEK_SET)
    if os.fstat(dst_fd).st_size < base + count:
        os.ftruncate(dst_fd, base + count)
class NoHashes:  # sha256 of ~240 GB of holes would take minutes and hold 16 MB of buffers at most
    def __init__(self, *a, **k): pass
    def submit(self, path): pass
    def submit_output(self, path): pass
    def results(self): return {}
    def close(self): pass
writer.copy_range = files.copy_range = sparse_copy  # shards (write_shard) and whole files (copy_file)
apply.InputHasher = NoHashes
apply.free_space = lambda path: 1 << 50
nv, bf, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
layers = tuple(int(x) for x in sys.argv[4].split(",") if x)
t = time.perf_counter()
plan = plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=out, bf16_expert_layers=layers, link=LinkMode.COPY))
plan.options.force = True
res = ex.execute(plan)
print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "passed": res.checks["passed"],
                  "written": res.shards_written,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def _one(cmd: list[str]) -> tuple[int, float, str]:
    # RUSAGE_CHILDREN keeps the maximum over all children, so each measurement runs under its own
    # intermediate process that reports its only child's peak.
    wrapper = (
        "import resource, subprocess, sys, time, json; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(p.stderr); "
        "print(json.dumps({'rc': p.returncode, 's': time.perf_counter() - t, "
        "'mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, 'out': p.stdout}))"
    )
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd[:5])[:200]} ... failed ({r['rc']}):\n{p.stderr[-2000:]}")
    return r["mb"], r["s"], r["out"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "qtool-mem397")
    ap.add_argument("--layers", default="0", help="--bf16-expert-layers of the assembly (default 0)")
    ap.add_argument("--keep", action="store_true", help="keep the sparse checkpoints for a re-run")
    a = ap.parse_args(argv)
    nv, bf = a.workdir / "nvfp4", a.workdir / "bf16"
    make = [sys.executable, str(ROOT / "benchmarks" / "make_sparse_397b.py")]
    for path, flavour in ((nv, "modelopt-nvfp4"), (bf, "bf16-fused")):
        if not (path / "model.safetensors.index.json").exists():
            subprocess.run([*make, str(path), "--flavour", flavour], check=True, stdout=subprocess.DEVNULL)
    qtool = [sys.executable, "-m", "qtool.cli.main"]
    rows = []
    mb, s, _ = _one([sys.executable, "-c", "import qtool.cli.main"])
    rows.append(("baseline: interpreter + qtool CLI imported", mb, s))
    mb, s, _ = _one([*qtool, "inspect", str(nv), "--json"])
    rows.append(("qtool inspect (NVFP4 397B)", mb, s))
    out = a.workdir / "out"
    mb, s, _ = _one(
        [
            *qtool,
            "assemble",
            "hybrid",
            "--nvfp4",
            str(nv),
            "--bf16",
            str(bf),
            "-o",
            str(out),
            "--bf16-expert-layers",
            a.layers,
            "--dry-run",
            "--json",
        ]
    )
    rows.append((f"assemble hybrid --dry-run (layers {a.layers})", mb, s))
    mb, s, got = _one([sys.executable, "-c", EXECUTE_METADATA, str(nv), str(bf), a.layers])
    info = json.loads(got.strip().splitlines()[-1])
    rows.append((f"assemble execute, metadata path ({info['tensors']} output tensors)", mb, s))
    mb, s, got = _one([sys.executable, "-c", EXECUTE_SPARSE, str(nv), str(bf), str(out), a.layers])
    info = json.loads(got.strip().splitlines()[-1])
    rows.append(
        (
            f"assemble execute, whole run, holes kept ({info['written']} shards, "
            f"checks {'passed' if info['passed'] else 'FAILED'})",
            mb,
            s,
        )
    )
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    print(f"{'job':70s} {'peak RSS':>9s} {'seconds':>8s}")
    for name, mb, s in rows:
        print(f"{name:70s} {mb:6d} MB {s:8.1f}")
    if not a.keep:
        import shutil

        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(main())
