#!/usr/bin/env python
"""How long a streamed job takes to start: process start to its first layer, and its wall time, for a
tiny quantize that tokenizes (each run gets an empty token cache: the plan loads the tokenizer), so that
imports and planning are all there is. Compare checkouts in the same run, interleaved (one machine's
noise is as large as the change):

    python scripts/bench_start.py --rounds 5 --tree /path/to/old/checkout --tree .

The first layer's start is the job's own clock (`first_layer_start` in the --json report). On a GPU
machine pass `--device cuda`; the tiny model (qtool.fixtures.tiny) is built once under --workdir.
`--path DIR` puts DIR on every run's path after the checkout: a folder with the gpu extra (fla-core) and
Triton installed (`pip install --target DIR`), whose import the decoder module pays for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_layer_start(report) -> float | None:
    if isinstance(report, dict):
        if report.get("first_layer_start"):
            return float(report["first_layer_start"])
        report = list(report.values())
    if isinstance(report, list):
        for v in report:
            found = _first_layer_start(v)
            if found:
                return found
    return None


def run_once(tree: Path, src: Path, work: Path, device: str, path: list[Path]) -> tuple[float, float]:
    out, cache = work / "out", work / f"cache-{abs(hash(str(tree)))}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache / "tokens", ignore_errors=True)  # the plan tokenizes; other caches stay warm
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [tree, *path])), "QTOOL_CACHE_DIR": str(cache)}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out), "--recipe",
                        "qwen35-nvfp4-experts", "--samples", "2", "--seq-len", "16", "--device", device, "--json"],
                       env=env, capture_output=True, text=True, cwd=str(tree))
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{tree}: quantize failed\n{p.stderr[-2000:]}")
    first = _first_layer_start(json.loads(p.stdout))
    if first is None:
        raise SystemExit(f"{tree}: no first_layer_start in the report")
    return first - t0, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", type=Path, help="a qtool checkout (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/qtool-bench-start"))
    ap.add_argument("--path", action="append", type=Path, default=[],
                    help="a folder put on each run's path after the checkout (repeatable)")
    a = ap.parse_args()
    trees = [t.resolve() for t in (a.tree or [ROOT])]
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.workdir / "bf16"
    if not (src / "config.json").exists():
        sys.path.insert(0, str(ROOT))
        from qtool.fixtures import tiny

        tiny.build_bf16(src)
    for tree in trees:  # untimed: bytecode and the caches other than the token cache
        run_once(tree, src, a.workdir, a.device, a.path)
    times: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    for r in range(a.rounds):
        for tree in trees:
            times[tree].append(run_once(tree, src, a.workdir, a.device, a.path))
            print(f"round {r + 1}: {tree}: first layer at {times[tree][-1][0]:.2f} s, wall {times[tree][-1][1]:.2f} s",
                  flush=True)
    print(f"{'checkout':60s} {'first layer s (median, min)':>28s} {'wall s (median)':>16s}")
    for tree, v in times.items():
        firsts = [x[0] for x in v]
        print(f"{str(tree):60s} {statistics.median(firsts):14.2f} {min(firsts):13.2f} "
              f"{statistics.median(x[1] for x in v):16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
