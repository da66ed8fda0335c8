#!/usr/bin/env python3
"""Where a streamed layer's time goes on the device: each layer of a checkpoint loaded (read, dequantized)
and run on a calibration-sized batch through qtool's layer streamer, the routed experts timed alone, and
the last layer under torch's profiler (the kernels by device time, the host calls by CPU time).

    python3 scripts/profile_streamed_layer.py CHECKPOINT [--device cuda] [--windows 16] [--seq-len 2048]

eval kld's layer on the H200 took 0.51 s against a 0.25 s read floor (issue 27); its main thread's
timeline put it in `forward_layer` and `routed_forward`, which a sampling profiler cannot split between the
host's launches and the device's kernels. This prints, per layer: the load (its bytes already read: the
streamer reads on demand here), the forward and a second forward (warm caches and kernels), and
`routed_forward` (qtool's eager expert loop) on random top-k routing of the same batch. Where torch has
`_grouped_mm`, the same experts as one grouped matmul per projection are timed beside it, with the largest
difference from the loop (the grouped form sums in another order: a candidate for eval kld only, whose
numbers need not match transformers' eager bit for bit). Use a real-size checkpoint
(scripts/bench_real_layers.py builds one; its `nvfp4` output is eval kld's input); on a CPU, a tiny one
checks the script.
"""

from __future__ import annotations

import argparse
import time


def _synced(device: str):
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return sync


def grouped_forward(experts, x, top_k_index, top_k_weights):
    """The routed experts as one grouped matmul per projection (torch._grouped_mm), summed in fp32 order
    of its own: for timing against the eager loop."""
    import torch

    n_tok, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # token-major: row r is token r // k
    order = torch.sort(flat, stable=True).indices
    offsets = torch.cumsum(torch.bincount(flat, minlength=experts.num_experts), 0).to(torch.int32)
    token = order // k
    gate_up = torch._grouped_mm(x[token], experts.gate_up_proj.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offsets)
    out = out * top_k_weights.reshape(-1)[order, None]
    final = torch.zeros_like(x)
    final.index_add_(0, token, out.to(x.dtype))
    return final


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from qtool.stream import experts as routed
    from qtool.stream.layer_stream import LayerStreamer, MemoryStore

    st = LayerStreamer(a.checkpoint, device=a.device)
    sync = _synced(a.device)
    h, n, seq = st.hidden_size, a.windows, a.seq_len
    store = MemoryStore(torch.randn(n, seq, h, dtype=st.dtype, device=a.device) * 0.5)
    batch = st.batch_windows(seq)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    for idx in range(st.num_layers):
        sync()
        t = time.perf_counter()
        layer = st.load_layer(idx)
        sync()
        load = time.perf_counter() - t
        runs = []
        for _ in range(2):
            t = time.perf_counter()
            st.forward_layer(layer, store, seq, batch)
            sync()
            runs.append(time.perf_counter() - t)
        print(f"layer {idx} ({st.mm.layer_types[idx]}): load {load:.3f} s, forward {runs[0]:.3f} s, "
              f"again {runs[1]:.3f} s", flush=True)
        ex = layer.mlp.experts
        x = store.t.reshape(-1, h)[: batch * seq].clone()
        top_k = min(int(st.text_cfg_dict.get("num_experts_per_tok", 8)), ex.num_experts)
        weights, index = torch.topk(torch.softmax(torch.randn(x.shape[0], ex.num_experts, device=x.device), -1),
                                    top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        for name, fn in (("routed_forward (eager loop)", routed.routed_forward), ("grouped matmul", grouped_forward)):
            if fn is grouped_forward and not hasattr(torch, "_grouped_mm"):
                continue
            try:
                for _ in range(2):  # the second: warm kernels
                    sync()
                    t = time.perf_counter()
                    y = fn(ex, x, index, weights)
                    sync()
                    took = time.perf_counter() - t
            except RuntimeError as e:  # _grouped_mm's device and dtype support vary by torch release
                print(f"  {name}: not run ({str(e).splitlines()[0][:160]})")
                continue
            if fn is routed.routed_forward:
                ref = y
                print(f"  {name}: {took:.3f} s")
            else:
                diff = (y.float() - ref.float()).abs()
                print(f"  {name}: {took:.3f} s, largest difference {diff.max().item():.3g} "
                      f"(mean |loop| {ref.float().abs().mean().item():.3g})")
        if idx == st.num_layers - 1:
            with profile(activities=activities) as prof:
                st.forward_layer(layer, store, seq, batch)
                sync()
            key = "cuda_time_total" if a.device.startswith("cuda") else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
        del layer
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    st.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
