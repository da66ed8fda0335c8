#!/usr/bin/env python
"""Time GPTQ's solver on a CUDA GPU at the 397B's real expert shapes, one solve group at a time.

    python benchmarks/bench_gptq_gpu.py [--experts 32 --runs 3] [--scales fixed,max,mse_sweep,local_hessian]
                                        [--profile] [--json out.json]

A solve group is what gptq_layer codes at once (hessians.SOLVE_EXPERTS experts): gate_proj and up_proj
stacked as one [E, 2048, 4096] matrix with one Hessian [E, 4096, 4096], and down_proj [E, 4096, 1024] with
a Hessian [E, 1024, 1024]. Weights are trained-like (Gaussian with outlier columns), Hessians those of
random activations whose channels differ in scale (the solver's cost does not depend on the values).
For each part it times, as medians after one warmup: `gptq.factor` (damping, Cholesky, inverse, Cholesky)
and `gptq.solve` with the fixed max grid, and with each block's scale chosen as GPTQ reaches it
(`gptq.scales: updated` with max, mse_sweep or local_hessian). The per-layer projection is 512 / E groups
of (gate_up + down): the solver's share of a 397B layer's quantize time (the forward and the Hessians'
accumulation come on top). `--profile` prints the CUDA kernels of one fixed-grid solve of gate_up (counts
and times: how much of the wall is kernel time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench_block_scales_gpu import expert_weights  # the same trained-like experts

HIDDEN, INTER, LAYER_EXPERTS = 4096, 1024, 512


def _time_s(fn: Callable[[], Any], runs: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _hessians(experts: int, n_in: int, tokens: int = 2048):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    scale = torch.logspace(-1, 1, n_in, device="cuda")[torch.randperm(n_in, device="cuda", generator=g)]
    h = torch.empty(experts, n_in, n_in, device="cuda")
    for e in range(experts):
        x = torch.randn(tokens, n_in, device="cuda", generator=g) * scale
        h[e] = x.T @ x
    return h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--scales", default="fixed,max,mse_sweep,local_hessian")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)

    import torch

    from qtool.formats import nvfp4
    from qtool.ops.quantize import gptq
    from qtool.ops.quantize.gptq_layer import UpdatedScales
    from qtool.recipes import WeightScale

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows: dict[str, dict[str, float]] = {}
    for part, (out, n_in) in {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}.items():
        w, h = expert_weights(a.experts, out, n_in), _hessians(a.experts, n_in)
        amax = nvfp4.matrix_amax(w)
        ws2 = nvfp4.weight_scale_2_from_amax(amax).reshape(-1).float()
        fac = gptq.factor(h)
        rows[part] = {"factor_s": _time_s(lambda h=h: gptq.factor(h), a.runs)}
        grid = gptq.nvfp4_grid(nvfp4.block_scales(w, ws2), ws2)
        for scales in a.scales.split(","):
            if scales == "fixed":
                fn = lambda w=w, fac=fac, grid=grid: gptq.solve(w, fac, grid)  # noqa: E731
            else:
                seen = torch.ones(a.experts, dtype=torch.bool, device="cuda")

                def fn(w=w, fac=fac, scales=scales, amax=amax, ws2=ws2, seen=seen):
                    chosen = UpdatedScales(WeightScale(scales), amax, ws2, seen, w.shape[-2], fac.u)
                    placeholder = gptq.nvfp4_grid(torch.ones_like(chosen.block_scale), ws2)
                    return gptq.solve(w, fac, placeholder, choose=chosen)

            rows[part][f"solve_{scales}_s"] = _time_s(fn, a.runs)
            print(f"{part} {scales}: {rows[part][f'solve_{scales}_s']:.3f} s", flush=True)
        if a.profile and part == "gate_up":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                gptq.solve(w, fac, grid)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        del w, h, fac
        torch.cuda.empty_cache()
    groups = LAYER_EXPERTS / a.experts
    per_layer = {key: groups * (rows["gate_up"][key] + rows["down"][key]) for key in rows["gate_up"]}
    name = torch.cuda.get_device_name()
    print(f"device: {name}; one group of {a.experts} experts (s), and the solver's seconds per 397B layer:")
    for key in rows["gate_up"]:
        print(
            f"  {key:24s} gate_up {rows['gate_up'][key]:7.3f}  down {rows['down'][key]:7.3f}"
            f"  {per_layer[key]:7.2f} s/layer"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(
                {"device": name, "experts": a.experts, "per_group_s": rows, "per_layer_s": per_layer}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
