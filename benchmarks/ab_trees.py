#!/usr/bin/env python3
"""One qtool command run from two (or more) source trees in turn: the wall clock, and from the command's
report, when its first layer began loading and when each layer was done. For an A/B of a change on the same
machine, in the same page cache, interleaved (A B, B A, ...) so that a drift of the machine falls on both.

    python3 benchmarks/ab_trees.py 4 new=. old=/tmp/old -- quantize SRC -o OUT --recipe ... --force --device cuda

where /tmp/old holds the other tree (`git archive REV qtool | tar -x -C /tmp/old`). Each run is
`python -P -m qtool ARGS --json --quiet` with the tree first on PYTHONPATH (Python 3.11+: `-P` keeps the
working folder, a checkout of its own, from coming first). Per run: wall; start (launch to the first
layer's load); loop (that to the last layer done); per_layer (a steady layer: the first layer done to the last but one,
with 3 or more layers, as
bench_real_layers.py counts it); tail (what the last layer took beyond a steady one: quantize's last shard
hash); end (the last layer done to the process's exit). Then each tree's means.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench_real_layers import layer_clock, steady_layer  # (this folder is the script's: first on the path)

FIELDS = ("wall", "start", "loop", "per_layer", "tail", "end")


def run_once(tag: str, tree: str, args: list[str]) -> dict | None:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launched = time.time()
    t0 = time.perf_counter()
    # -P: the working folder does not come before PYTHONPATH (as `python -m` puts it), so that a run in a
    # checkout imports the tree it is given; relative paths in ARGS stay the caller's
    p = subprocess.run(
        [sys.executable, "-P", "-m", "qtool", *args, "--json", "--quiet"], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    if p.returncode:
        print(f"{tag}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}", flush=True)
        return None
    clock = layer_clock(json.loads(p.stdout))
    if not clock.get("layers_done"):
        print(f"{tag}: the report has no layer clock (not a layer-streamed run?)", flush=True)
        return None
    done, first = clock["layers_done"], clock["first_layer_start"]
    per_layer, tail = steady_layer(done, first)
    return {
        "tag": tag,
        "wall": wall,
        "start": first - launched,
        "loop": done[-1] - first,
        "per_layer": per_layer,
        "tail": tail,
        "end": launched + wall - done[-1],
    }


def main() -> int:
    if "--" not in sys.argv or len(sys.argv) < 4:
        raise SystemExit(__doc__)
    split = sys.argv.index("--")
    rounds = int(sys.argv[1])
    trees = [t.split("=", 1) for t in sys.argv[2:split]]
    args = sys.argv[split + 1 :]
    rows = []
    for r in range(rounds):
        for tag, tree in trees if r % 2 == 0 else trees[::-1]:
            row = run_once(tag, tree, args)
            if row is not None:
                rows.append(row)
                print(" ".join([f"{tag:8s}"] + [f"{k}={row[k]:.2f}" for k in FIELDS]), flush=True)
    for tag, _ in trees:
        mine = [x for x in rows if x["tag"] == tag]
        if mine:
            print(
                " ".join(
                    [f"{tag:8s} mean of {len(mine)}:"]
                    + [f"{k}={sum(x[k] for x in mine) / len(mine):.2f}" for k in FIELDS]
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
