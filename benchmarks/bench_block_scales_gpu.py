#!/usr/bin/env python
"""Time the NVFP4 block-scale searches on a CUDA GPU at the 397B's real expert shapes, next to RTN from max.

    python benchmarks/bench_block_scales_gpu.py [--experts 32 --runs 10] [--json out.json]

For a chunk of E experts (default 32) of gate/up [1024, 4096] and down [4096, 1024] (BF16, trained-like:
Gaussian with outlier columns) it times, as CUDA-event medians after warmup: RTN (`quantize_fast`), the
`mse_sweep` Triton kernel trying all 126 candidates per block (`prune=False`) and trying each block's
window (the default), `four_over_six` (its Triton kernel) and `local_hessian` (its Triton kernel, dwᵀ H_b dw
with a full-float32 [rows, 16] x [16, 16] product, H from random activations: all 126 candidates, and the
default pruned search). Before timing, the windowed sweep's bytes are compared with the full sweep's, and the
pruned local_hessian's with its every-candidate search's (they must be equal). The
per-layer projection is what each search adds to a 397B layer: 512 experts = 512/E chunks of (gate + up +
down).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

SHAPES = {"gate_up": (1024, 4096), "down": (4096, 1024)}
LAYER_EXPERTS = 512


def _time_ms(fn: Callable[[], Any], runs: int, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def expert_weights(experts: int, out: int, n_in: int):
    """[experts, out, n_in] BF16 on the GPU, trained-like: Gaussian with an outlier column every n_in / 8."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(experts, out, n_in, device="cuda", generator=g) * 0.02
    w[:, :, :: n_in // 8] *= 20  # outlier columns
    return w.to(torch.bfloat16)


def _hessians(experts: int, n_in: int):
    """[experts, n_in/16, 16, 16] float32: each column block's second moments of random activations whose
    channels differ in scale (the search's cost does not depend on the values)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, n_in // 16, 16, device="cuda", generator=g) * torch.logspace(-1, 1, 16, device="cuda")
    per_block = torch.einsum("tbi,tbj->bij", x, x) / 256
    return per_block.expand(experts, -1, -1, -1).contiguous()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)

    import torch

    from qtool.formats import nvfp4
    from qtool.formats import nvfp4_triton as nt
    from qtool.ops.quantize.nvfp4_mse import four_over_six_block_scales

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows: dict[str, dict[str, float]] = {}
    for shape, (out, n_in) in SHAPES.items():
        w = expert_weights(a.experts, out, n_in)
        amax = nvfp4.matrix_amax(w)
        full = nt.sweep_block_scales_triton(w, amax, prune=False)
        windowed = nt.sweep_block_scales_triton(w, amax)
        differ = int((full.view(torch.uint8) != windowed.view(torch.uint8)).sum())
        print(f"{shape} {a.experts}x[{out},{n_in}]: windowed vs full sweep: {differ} of {full.numel()} bytes differ")
        if differ:
            return 3
        rows[shape] = {
            "rtn_ms": _time_ms(lambda w=w, amax=amax: nt.quantize_fast(w, global_amax=amax), a.runs),
            "sweep_full_ms": _time_ms(
                lambda w=w, amax=amax: nt.sweep_block_scales_triton(w, amax, prune=False), a.runs
            ),
            "sweep_windowed_ms": _time_ms(lambda w=w, amax=amax: nt.sweep_block_scales_triton(w, amax), a.runs),
            "four_over_six_ms": _time_ms(lambda w=w, amax=amax: four_over_six_block_scales(w, amax), a.runs),
        }
        h, ws2 = _hessians(a.experts, n_in), nvfp4.weight_scale_2_from_amax(amax)
        full = nt.hessian_block_scales_triton(w, ws2, h, prune=False)
        pruned = nt.hessian_block_scales_triton(w, ws2, h)
        differ = int((full.view(torch.uint8) != pruned.view(torch.uint8)).sum())
        print(f"{shape}: local_hessian pruned vs every candidate: {differ} of {full.numel()} bytes differ")
        if differ:
            return 3
        rows[shape]["local_hessian_full_ms"] = _time_ms(
            lambda w=w, ws2=ws2, h=h: nt.hessian_block_scales_triton(w, ws2, h, prune=False), a.runs
        )
        rows[shape]["local_hessian_ms"] = _time_ms(
            lambda w=w, ws2=ws2, h=h: nt.hessian_block_scales_triton(w, ws2, h), a.runs
        )
    chunks = LAYER_EXPERTS / a.experts
    per_layer = {
        key: chunks * (2 * rows["gate_up"][key] + rows["down"][key]) / 1000
        for key in rows["gate_up"]
        if key != "rtn_ms"
    }
    name = torch.cuda.get_device_name()
    print(f"device: {name}; per call of {a.experts} experts (ms), and seconds added per 397B layer (512 experts):")
    for key in rows["gate_up"]:
        added = "" if key == "rtn_ms" else f"  +{per_layer[key]:.3f} s/layer"
        print(f"  {key:18s} gate_up {rows['gate_up'][key]:8.2f}  down {rows['down'][key]:8.2f}{added}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(
                {"device": name, "experts": a.experts, "per_call_ms": rows, "per_layer_s": per_layer}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
