#!/usr/bin/env python
"""Build a sparse real-scale Qwen3.5-MoE checkpoint (real headers, holes for data).

    python benchmarks/make_sparse_397b.py OUT --flavour modelopt-nvfp4 [--model 397b] [--no-mtp]
        [--no-vision] [--kv-scales/--no-kv-scales] [--num-shards N] [--no-fill-scalars] [--measure]

--measure also times qtool.io.checkpoint.Checkpoint.open on the result and reports peak RSS
(ru_maxrss of this process, so the build's own peak is included; run it on an existing OUT with
--open-only for the open alone).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from qtool.fixtures.sparse import MODELS, Flavour, build_sparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="397b", choices=sorted(MODELS))
    ap.add_argument("--flavour", default="modelopt-nvfp4", choices=[f.value for f in Flavour])
    ap.add_argument("--no-mtp", dest="mtp", action="store_false")
    ap.add_argument("--no-vision", dest="vision", action="store_false")
    ap.add_argument("--kv-scales", dest="kv_scales", action="store_true", default=None)
    ap.add_argument("--no-kv-scales", dest="kv_scales", action="store_false")
    ap.add_argument("--num-shards", type=int, default=None)
    ap.add_argument("--no-fill-scalars", dest="fill_scalars", action="store_false")
    ap.add_argument("--quantize-shared-expert", action="store_true")
    ap.add_argument("--mtp-experts", choices=["bf16-fused", "bf16-per-expert"], default=None)
    ap.add_argument("--measure", action="store_true", help="time Checkpoint.open and report peak RSS")
    ap.add_argument("--open-only", action="store_true", help="do not build; only measure OUT")
    a = ap.parse_args(argv)

    report: dict = {"out": str(a.out)}
    if not a.open_only:
        t = time.perf_counter()
        build_sparse(
            a.out,
            model=a.model,
            flavour=a.flavour,
            mtp=a.mtp,
            vision=a.vision,
            kv_scales=a.kv_scales,
            num_shards=a.num_shards,
            fill_scalars=a.fill_scalars,
            quantize_shared_expert=a.quantize_shared_expert,
            mtp_experts=a.mtp_experts,
        )
        report["build_s"] = round(time.perf_counter() - t, 3)
        report["build_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    shards = sorted(a.out.glob("*.safetensors"))
    index = json.loads((a.out / "model.safetensors.index.json").read_text())
    report["shards"] = len(shards)
    report["tensors"] = len(index["weight_map"])
    report["total_size"] = index["metadata"]["total_size"]
    report["apparent_bytes"] = sum(p.stat().st_size for p in shards)
    report["allocated_bytes"] = sum(p.stat().st_blocks * 512 for p in a.out.iterdir() if p.is_file())
    if a.measure or a.open_only:
        from qtool.io.checkpoint import Checkpoint

        t = time.perf_counter()
        ck = Checkpoint.open(a.out)
        report["checkpoint_open_s"] = round(time.perf_counter() - t, 3)
        report["checkpoint_tensors"] = len(ck.tensors)
        report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        report["cpus"] = os.cpu_count()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
