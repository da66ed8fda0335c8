"""Train the quality proxy (qtool.fixtures.proxy): a small Qwen3.5-MoE in the real layout trained on the
installed transformers' modeling sources, saved as weights.safetensors, tokenizer.json and proxy.json.

    python benchmarks/make_proxy.py --device cuda --out benchmarks/proxy --max-seconds 420
    python benchmarks/make_proxy.py --device cpu --out /tmp/proxy --steps 5 --batch 2 --seq-len 64  # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtool.fixtures.proxy import TrainPlan, train_and_save  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cpu")
    defaults = TrainPlan()
    ap.add_argument("--steps", type=int, default=defaults.steps)
    ap.add_argument("--batch", type=int, default=defaults.batch)
    ap.add_argument("--seq-len", type=int, default=defaults.seq_len)
    ap.add_argument("--lr", type=float, default=defaults.lr)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--max-seconds", type=float, default=None, help="cut the steps to what fits this budget")
    a = ap.parse_args()
    plan = TrainPlan(steps=a.steps, batch=a.batch, seq_len=a.seq_len, lr=a.lr, seed=a.seed, max_seconds=a.max_seconds)
    train_and_save(a.out, device=a.device, plan=plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
