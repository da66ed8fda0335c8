"""Benchmark calibrate-kv's layer-streamed forward: tokens/s and peak memory vs number of layers.

Builds a synthetic Qwen3.5-MoE checkpoint (random BF16 weights, a scaled config: hidden 1024, 64
experts x 512, so each decoder layer is ~0.2 GB and 16 layers ~3.3 GB), then for each layer count runs
the calibration (hidden states in RAM) in a fresh subprocess and reports its peak RSS above the
post-import baseline (CPU) or torch.cuda.max_memory_allocated (GPU), against the target
`2 x one layer's weights + the calibration set's hidden states`.

    python benchmarks/bench_calibrate_kv.py --dir /tmp/kvbench --layers 4 8 16 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

H, HEADS, KV, HD, E, TOPK, INTER, VOCAB = 1024, 8, 2, 128, 64, 4, 512, 4096
LK, LV, LD = 4, 8, 128


def text_config(n_layers: int) -> dict:
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": H,
        "num_hidden_layers": n_layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "attn_output_gate": True,
        "linear_num_key_heads": LK,
        "linear_key_head_dim": LD,
        "linear_num_value_heads": LV,
        "linear_value_head_dim": LD,
        "linear_conv_kernel_dim": 4,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": INTER,
        "shared_expert_intermediate_size": INTER,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "partial_rotary_factor": 0.25,
    }


def layer_tensors(i: int, full: bool, g):
    import torch

    def r(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    p = f"model.language_model.layers.{i}."
    t = {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H)}
    if full:
        a = p + "self_attn."
        t.update(
            {
                a + "q_proj.weight": r(HEADS * HD * 2, H),
                a + "k_proj.weight": r(KV * HD, H),
                a + "v_proj.weight": r(KV * HD, H),
                a + "o_proj.weight": r(H, HEADS * HD),
                a + "q_norm.weight": r(HD),
                a + "k_norm.weight": r(HD),
            }
        )
    else:
        a = p + "linear_attn."
        conv = LK * LD * 2 + LV * LD
        t.update(
            {
                a + "in_proj_qkv.weight": r(conv, H),
                a + "in_proj_z.weight": r(LV * LD, H),
                a + "in_proj_b.weight": r(LV, H),
                a + "in_proj_a.weight": r(LV, H),
                a + "conv1d.weight": r(conv, 1, 4, std=0.3),
                a + "A_log": r(LV, std=0.5),
                a + "dt_bias": r(LV, std=0.5),
                a + "norm.weight": r(LD),
                a + "out_proj.weight": r(H, LV * LD),
            }
        )
    m = p + "mlp."
    t.update(
        {
            m + "gate.weight": r(E, H),
            m + "shared_expert_gate.weight": r(1, H),
            m + "shared_expert.gate_proj.weight": r(INTER, H),
            m + "shared_expert.up_proj.weight": r(INTER, H),
            m + "shared_expert.down_proj.weight": r(H, INTER),
        }
    )
    for e in range(E):
        x = f"{m}experts.{e}."
        t.update(
            {
                x + "gate_proj.weight": r(INTER, H),
                x + "up_proj.weight": r(INTER, H),
                x + "down_proj.weight": r(H, INTER),
            }
        )
    return t


def build(root: Path, max_layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    base = root / f"L{max_layers}"
    if (base / "model.safetensors.index.json").exists():
        return
    base.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    wm = {}
    emb = {
        "model.language_model.embed_tokens.weight": (torch.randn(VOCAB, H, generator=g) * 0.02).to(torch.bfloat16),
        "model.language_model.norm.weight": torch.zeros(H, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(VOCAB, H, generator=g) * 0.02).to(torch.bfloat16),
    }
    save_file(emb, base / "model-embed.safetensors")
    wm.update({k: "model-embed.safetensors" for k in emb})
    for i in range(max_layers):
        t = layer_tensors(i, (i + 1) % 4 == 0, g)
        name = f"model-layer{i:03d}.safetensors"
        save_file(t, base / name)
        wm.update({k: name for k in t})
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def variant(root: Path, max_layers: int, n: int) -> Path:
    """A checkpoint of the first n layers: hard links to the shards, its own config and index."""
    base = root / f"L{max_layers}"
    d = root / f"v{n}"
    d.mkdir(exist_ok=True)
    idx = json.loads((base / "model.safetensors.index.json").read_text())
    keep = {"model-embed.safetensors"} | {f"model-layer{i:03d}.safetensors" for i in range(n)}
    wm = {k: v for k, v in idx["weight_map"].items() if v in keep}
    for s in keep:
        if not (d / s).exists():
            os.link(base / s, d / s)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config(n),
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def child(ckpt: str, samples: int, seq_len: int, device: str) -> None:
    import torch
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401  (imports out of the figure)

    from qtool.ops import calibrate_kv as ck

    torch.manual_seed(0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    p = ck.plan(
        ck.CalibrateKvOptions(Path(ckpt), out=Path(ckpt + ".out"), samples=samples, seq_len=seq_len, device=device)
    )
    ids = torch.randint(0, VOCAB, (samples, seq_len))
    t0 = time.perf_counter()
    stats, timing = ck.calibrate(p, ids, hidden="memory")
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "layers": p.stream.num_layers,
        "tokens": samples * seq_len,
        "seconds": dt,
        "tokens_per_s": samples * seq_len / dt,
        "layer_bytes": p.stream.max_layer_bytes,
        "hidden_bytes": p.stream.hidden_bytes,
        "rss_base": base,
        "rss_peak": peak,
        "k_scales": [stats[i].k_scale for i in p.layers],
    }
    if device != "cpu":
        out["gpu_peak"] = torch.cuda.max_memory_allocated()
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/kvbench")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]), a.child[3])
        return
    root = Path(a.dir)
    t0 = time.perf_counter()
    build(root, max(a.layers))
    print(f"synthetic checkpoint: {max(a.layers)} layers built in {time.perf_counter() - t0:.0f} s under {root}")
    mib = 1 << 20
    print(
        f"{'layers':>6} {'tokens/s':>9} {'layer MiB':>9} {'hidden MiB':>10} {'peak-base MiB':>13} "
        f"{'target MiB':>10} {'ratio':>6}" + ("  gpu MiB" if a.device != "cpu" else "")
    )
    for n in a.layers:
        d = variant(root, max(a.layers), n)
        r = subprocess.run(
            [sys.executable, __file__, "--child", str(d), str(a.samples), str(a.seq_len), a.device],
            capture_output=True,
            text=True,
        )
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(r.stdout[-2000:], r.stderr[-4000:])
            continue
        o = json.loads(line[7:])
        used = o["rss_peak"] - o["rss_base"]
        target = 2 * o["layer_bytes"] + o["hidden_bytes"]
        gpu = f"  {o['gpu_peak'] / mib:7.0f}" if "gpu_peak" in o else ""
        print(
            f"{n:>6} {o['tokens_per_s']:>9.1f} {o['layer_bytes'] / mib:>9.0f} {o['hidden_bytes'] / mib:>10.1f} "
            f"{used / mib:>13.0f} {target / mib:>10.0f} {used / target:>6.2f}{gpu}"
        )


if __name__ == "__main__":
    main()
