"""CPU NVFP4 weight-quantization throughput: qtool's codec vs ModelOpt's NVFP4QTensor.quantize vs
compressed-tensors' quantize + pack_fp4_to_uint8, on the same BF16 tensors (GB/s of BF16 input).

Each peer does the full job it does on export: ModelOpt computes the global and block scales and packs;
compressed-tensors gets qtool's (identical) scales and does quantize + pack, so the comparison favours
it. Usage: python benchmarks/bench_nvfp4_codec.py [--experts 4] [--out 1024] [--in 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--in", dest="inp", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from qtool.formats import nvfp4

    torch.manual_seed(0)
    ws = [torch.randn(a.out, a.inp, dtype=torch.bfloat16) * 0.02 for _ in range(a.experts)]
    gb = sum(w.numel() * 2 for w in ws) / 1e9

    def qtool_run():
        for w in ws:
            nvfp4.quantize(w)

    def modelopt_run():
        for w in ws:
            NVFP4QTensor.quantize(w, 16)

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    pre = []
    for w in ws:
        q = nvfp4.quantize(w)
        pre.append((q.block_scale, (1.0 / q.weight_scale_2).reshape(1)))

    def ct_run():
        for w, (bs, gs) in zip(ws, pre, strict=True):
            x = ct_quantize(w, scale=bs.to(torch.float32) / gs, zero_point=None, args=args, global_scale=gs)
            pack_fp4_to_uint8(x)

    # correctness first: qtool == ModelOpt bytes
    q = nvfp4.quantize(ws[0])
    mo = NVFP4QTensor.quantize(ws[0], 16)
    same = torch.equal(q.packed, mo[0]._quantized_data)
    t = {
        "qtool": _best(qtool_run, a.repeat),
        "modelopt": _best(modelopt_run, a.repeat),
        "compressed-tensors": _best(ct_run, a.repeat),
    }
    print(
        f"{a.experts} x [{a.out}, {a.inp}] bf16 = {gb:.3f} GB; torch threads {torch.get_num_threads()}; "
        f"qtool packed bytes == modelopt: {same}"
    )
    for k, v in t.items():
        print(f"  {k:<20} {gb / v:7.3f} GB/s   ({v:.3f} s)   qtool speed-up x{v / t['qtool']:.2f}")


if __name__ == "__main__":
    main()
