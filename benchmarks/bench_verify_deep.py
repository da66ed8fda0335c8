"""Benchmark `verify --deep` hashing against `cat FILES > /dev/null` and `sha256sum FILES` on the same files.

    python benchmarks/bench_verify_deep.py [--dir D] [--gb 4] [--files 4]

Writes FILES of random (non-sparse) data, drops nothing from the page cache (run as root with
--drop-caches to measure the disk; otherwise all three read from the cache, measuring CPU + memory),
then times, in one run: cat (sequential read baseline), sha256sum (single-threaded hash baseline),
qtool's parallel hasher (hash only) and hash + numeric scan. Prints GB/s and ratios vs cat.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--drop-caches", action="store_true")
    a = ap.parse_args()
    from qtool.io.safetensors_header import TensorInfo
    from qtool.ops.verify.deep import hash_files

    d = Path(a.dir or tempfile.mkdtemp(prefix="qtool-bench-deep-"))
    d.mkdir(parents=True, exist_ok=True)
    per = int(a.gb * 1e9 / a.files) // (16 << 20) * (16 << 20)
    files = []
    for i in range(a.files):
        p = d / f"shard-{i}.bin"
        if not p.exists() or p.stat().st_size != per:
            with open(p, "wb") as f:
                block = os.urandom(16 << 20)
                for _ in range(per // len(block)):
                    f.write(block[::-1] if _ % 2 else block)
        files.append(str(p))
    total = per * a.files

    def prep() -> None:
        if a.drop_caches:
            drop_caches()
        else:
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm: compare like with like

    results = {}
    prep()
    results["cat"] = timed(lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True))
    prep()
    results["sha256sum"] = timed(lambda: subprocess.run(["sha256sum", *files], stdout=subprocess.DEVNULL, check=True))
    prep()
    results["qtool hash"] = hash_files(files)[1]
    # scan: treat each file as one BF16 tensor after an 8-byte "header"
    tensors = {f: [TensorInfo("t", f, "BF16", ((per - 8) // 2,), 8, per)] for f in files}
    prep()
    results["qtool hash+scan"] = hash_files(files, tensors=tensors)[1]
    base = results["cat"]
    print(
        f"{total / 1e9:.2f} GB in {a.files} files, cpus={os.cpu_count()}, "
        f"{'cold (drop_caches)' if a.drop_caches else 'page cache warm'}"
    )
    for k, s in results.items():
        print(f"  {k:<16} {s:7.2f} s  {total / s / 1e9:6.2f} GB/s  {base / s:5.2f}x cat")


if __name__ == "__main__":
    main()
