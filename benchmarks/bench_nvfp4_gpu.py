#!/usr/bin/env python
"""Benchmark NVFP4 RTN weight quantization on a CUDA GPU: qtool's Triton kernel against qtool's torch
codec, ModelOpt `NVFP4QTensor.quantize` and compressed-tensors quantize + pack, on the same tensors,
with a device-to-device copy of the same BF16 bytes measured in the same run as the speed ceiling.

    python benchmarks/bench_nvfp4_gpu.py [--experts 64 --out-features 1024 --in-features 4096]
                                      [--runs 20 --peer-runs 3] [--json results.json]

Throughput is GB/s of BF16 weights consumed (E * out * in * 2 bytes / median time; GB = 1e9 B). Times
are CUDA-event medians after warmup. ModelOpt and compressed-tensors are called one expert matrix at a
time, which is how their exports quantize a module's weight (per-matrix amax -> weight_scale_2); qtool's
codecs take the whole [E, out, in] stack at once. Before timing, the Triton result is compared bit for
bit with the torch codec and with ModelOpt (codes, block scales, weight_scale_2); the counts are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

GB = 1e9


def _time_ms(fn: Callable[[], Any], runs: int, warmup: int) -> list[float]:
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
    return times


def _ct_quantize_pack(w):  # one [out, in] matrix, as llm-compressor's NVFP4 weight path does
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = NVFP4["weights"]
    blocks = w.unflatten(-1, (-1, 16))
    mn, mx = torch.amin(blocks, dim=-1), torch.amax(blocks, dim=-1)
    gmax = torch.max(mx.max(), -mn.min())
    gs = generate_gparam(-gmax.reshape(1), gmax.reshape(1))
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    q = quantize(x=w, scale=scale, zero_point=zp, global_scale=gs, args=args)
    return pack_fp4_to_uint8(q), scale.to(torch.float8_e4m3fn), gs


def _identity(w, tile) -> dict[str, Any]:
    import torch

    from qtool.formats import nvfp4
    from qtool.formats import nvfp4_triton as nt

    ours = nt.quantize_triton(w, tile=tile)
    ref = nvfp4.quantize(w)
    out: dict[str, Any] = {
        "vs_torch_codec": {
            "code_bytes_diff": int((ours.packed != ref.packed).sum()),
            "scale_diff": int((ours.block_scale.view(torch.uint8) != ref.block_scale.view(torch.uint8)).sum()),
            "ws2_diff": int((ours.weight_scale_2.view(torch.int32) != ref.weight_scale_2.view(torch.int32)).sum()),
        }
    }
    try:
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    except ImportError as e:
        out["vs_modelopt"] = f"not run: {e}"
        return out
    d = {"code_bytes_diff": 0, "scale_diff": 0, "ws2_diff": 0}
    for e in range(w.shape[0]):
        qt, s, s2 = NVFP4QTensor.quantize(w[e], 16)
        d["code_bytes_diff"] += int((qt._quantized_data != ours.packed[e]).sum())
        d["scale_diff"] += int((s.view(torch.uint8) != ours.block_scale[e].view(torch.uint8)).sum())
        d["ws2_diff"] += int(s2.float().view(torch.int32).item() != ours.weight_scale_2[e].view(torch.int32).item())
    out["vs_modelopt"] = d
    out["elements"] = w.numel()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--out-features", type=int, default=1024)
    p.add_argument("--in-features", type=int, default=4096)
    p.add_argument("--runs", type=int, default=20, help="timed runs of the copy and the Triton kernel")
    p.add_argument("--peer-runs", type=int, default=3, help="timed runs of the slower peers")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    import torch

    from qtool.formats import nvfp4
    from qtool.formats import nvfp4_triton as nt

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    shape = (args.experts, args.out_features, args.in_features)
    w = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
    nbytes = w.numel() * w.element_size()
    tiles = [
        nt.TileConfig(block_rows=r, blocks_per_tile=b, num_warps=nw)
        for r, b, nw in ((16, 16, 4), (8, 32, 4), (32, 16, 8), (16, 32, 8), (64, 8, 8))
    ]

    rows: list[dict[str, Any]] = []

    def add(name: str, fn: Callable[[], Any], runs: int, warmup: int, **extra: Any) -> float:
        t = _time_ms(fn, runs, warmup)
        med = statistics.median(t)
        rows.append(
            {
                "method": name,
                "median_ms": med,
                "min_ms": min(t),
                "max_ms": max(t),
                "runs": runs,
                "gb_per_s": nbytes / (med / 1e3) / GB,
                **extra,
            }
        )
        return med

    dst = torch.empty_like(w)
    t_copy = add("memcpy (device copy of the BF16 bytes)", lambda: dst.copy_(w), args.runs, 5)
    best = None
    for tile in tiles:
        med = add(
            f"qtool triton {tile.block_rows}x{tile.blocks_per_tile}blk w{tile.num_warps}",
            lambda tile=tile: nt.quantize_triton(w, tile=tile),
            args.runs,
            3,
            tile=[tile.block_rows, tile.blocks_per_tile, tile.num_warps],
        )
        if best is None or med < best[0]:
            best = (med, tile)
    assert best is not None
    t_triton, tile = best
    identity = _identity(w, tile)

    peers: dict[str, float] = {}
    peers["qtool torch codec (batched)"] = add(
        "qtool torch codec (batched)", lambda: nvfp4.quantize(w), args.peer_runs, 1
    )
    try:
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

        peers["modelopt NVFP4QTensor.quantize"] = add(
            "modelopt NVFP4QTensor.quantize",
            lambda: [NVFP4QTensor.quantize(w[e], 16) for e in range(len(w))],
            args.peer_runs,
            1,
        )
    except ImportError as e:
        print(f"modelopt not run: {e}", file=sys.stderr)
    try:
        import compressed_tensors  # noqa: F401

        peers["compressed-tensors quantize+pack"] = add(
            "compressed-tensors quantize+pack",
            lambda: [_ct_quantize_pack(w[e]) for e in range(len(w))],
            args.peer_runs,
            1,
        )
    except ImportError as e:
        print(f"compressed-tensors not run: {e}", file=sys.stderr)

    # Bytes the Triton path must move: amax pass reads the input, quantize pass reads it again and writes
    # 0.5 B codes + 1/16 B scales per element.
    triton_bytes = w.numel() * (2 + 2 + 0.5 + 1 / 16)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": list(shape),
        "bf16_bytes": nbytes,
        "best_tile": [tile.block_rows, tile.blocks_per_tile, tile.num_warps],
        "rows": rows,
        "triton_ms": t_triton,
        "triton_gb_per_s": nbytes / (t_triton / 1e3) / GB,
        "triton_dram_gb_per_s_counted": triton_bytes / (t_triton / 1e3) / GB,
        "memcpy_dram_gb_per_s_read_plus_write": 2 * nbytes / (t_copy / 1e3) / GB,
        "triton_vs_memcpy_time": t_copy / t_triton,
        "speedup_vs": {k: v / t_triton for k, v in peers.items()},
        "identity": identity,
    }
    print(
        f"\nNVFP4 quantize, {args.experts} x [{args.out_features}, {args.in_features}] BF16 "
        f"({nbytes / GB:.2f} GB) on {result['device']}, torch {torch.__version__}"
    )
    print(f"{'method':48} {'median ms':>10} {'GB/s':>9} {'triton x':>9}")
    for r in rows:
        print(f"{r['method']:48} {r['median_ms']:10.3f} {r['gb_per_s']:9.1f} {r['median_ms'] / t_triton:9.2f}")
    print(
        f"triton: {result['triton_dram_gb_per_s_counted']:.0f} GB/s of counted DRAM traffic vs memcpy "
        f"{result['memcpy_dram_gb_per_s_read_plus_write']:.0f} GB/s read+write; "
        f"triton time = {t_triton / t_copy:.2f} x one copy of the BF16 bytes"
    )
    print("bit identity:", json.dumps(identity))
    print("JSON " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
