#!/usr/bin/env python
"""Count the candidate scales `local_hessian`'s pruned search tries per row, on a CPU, against trying all 126.

    python benchmarks/count_hessian_candidates.py [--rows 256 --blocks 32]

The GPU search's time is its candidates times the cost of one (a 16-element coding and a 16 x 16 product per
row), so the candidates a row tries are the work the pruning saves, on any machine. On weights and Hessians
made as `bench_block_scales_gpu.py` makes them (Gaussian experts with outlier columns, whose blocks sit far
below the matrix max; activations whose channels differ in scale), every candidate's dwᵀ H_b dw is computed
in float64, and the search order of the kernel (qtool.formats.nvfp4_triton._hessian_search_body) is replayed
on them: up from k_c - HESSIAN_BELOW while the bound from the elements coded 0 leaves the row a chance, then
down while the clipping bound does. Printed per row: candidates tried going up with and without the upward
bound (the latter: every candidate up to the largest), going down, and whether the winner is the one of all
126 (it must be).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--blocks", type=int, default=32, help="16-column blocks of a [rows, 4096] expert, spread evenly")
    a = p.parse_args(argv)

    import torch

    from qtool.formats import nvfp4
    from qtool.formats import nvfp4_triton as nt

    n_in = 4096
    g = torch.Generator().manual_seed(0)
    w = torch.randn(a.rows, n_in, generator=g) * 0.02
    w[:, :: n_in // 8] *= 20  # outlier columns, as bench_block_scales_gpu.expert_weights
    w = w.bfloat16().double()
    x = torch.randn(256, n_in // 16, 16, generator=g) * torch.logspace(-1, 1, 16)
    hessians = torch.einsum("tbi,tbj->bij", x, x) / 256
    inverse_diagonals = nt.hessian_inverse_diagonals(hessians).double()
    ws2 = float(nvfp4.weight_scale_2_from_amax(nvfp4.matrix_amax(w.float())))
    divisors = nvfp4.fp8_scale_bytes("cpu").view(torch.float8_e4m3fn).double() * ws2  # [126] ascending
    n_c = divisors.numel()
    margin = 1 + nt.HESSIAN_MARGIN
    up_all = up = down = same = rows = 0
    for b in torch.linspace(0, n_in // 16 - 1, a.blocks).long().tolist():
        xb, h, hinv = w[:, b * 16 : (b + 1) * 16], hessians[b].double(), inverse_diagonals[b]
        scaled = (xb[:, None, :] / divisors[None, :, None]).float()
        q = nvfp4.decode_e2m1(nvfp4.encode_e2m1(scaled)).double() * divisors[None, :, None]
        dw = xb[:, None, :] - q  # [rows, 126, 16]
        loss = torch.einsum("rki,ij,rkj->rk", dw, h, dw)
        zero_bound = torch.where(q == 0, (xb**2 / hinv)[:, None, :], 0.0).amax(-1)
        clip = (xb.abs()[:, None, :] - 6 * divisors[None, :, None]).clamp(min=0)
        clip_bound = (clip**2 / hinv).amax(-1)
        k_c = torch.searchsorted(6 * divisors, xb.abs().amax(-1)[:, None]).squeeze(-1).clamp(max=n_c - 1)
        for r in range(a.rows):
            first = max(int(k_c[r]) - nt.HESSIAN_BELOW, 0)
            best, best_k, k = float("inf"), 0, first
            while k < n_c:
                up += 1
                if float(loss[r, k]) < best:
                    best, best_k = float(loss[r, k]), k
                if float(zero_bound[r, k]) > best * margin:
                    break
                k += 1
            k = first - 1
            while k >= 0 and float(clip_bound[r, k]) <= best * margin:
                down += 1
                if float(loss[r, k]) <= best:
                    best, best_k = float(loss[r, k]), k
                k -= 1
            up_all += n_c - first
            same += best_k == int(loss[r].argmin())
            rows += 1
    print(f"{rows} rows of {a.blocks} blocks; candidates tried a row (of {n_c}):")
    print(f"  going up, every candidate to the largest: {up_all / rows:6.2f}")
    print(f"  going up, stopped by the bound:           {up / rows:6.2f}  ({up / up_all:.2f}x)")
    print(f"  going down:                               {down / rows:6.2f}")
    print(f"  winner = every candidate's: {same} of {rows}")
    return 0 if same == rows else 3


if __name__ == "__main__":
    sys.exit(main())
