#!/usr/bin/env python3
"""Data parallel vs one process on this machine's devices: quantize (NVFP4, AWQ, GPTQ), calibrate-kv and
eval kld with N ranks must give the same bytes / statistics as with one (what tests/dist/test_data_parallel.py
checks on CPU with gloo, here on GPUs). Prints a line per job and the wall times; exits 1 on a difference.

    python3 scripts/check_data_parallel.py --workdir /tmp/dp --device cuda --nproc 2
    python3 scripts/check_data_parallel.py --workdir /tmp/dp --device cuda --nproc 2 --same-gpu
        # a one-GPU machine: both ranks on cuda:0 (the statistics go over gloo, so NCCL's one-rank-per-GPU
        # rule does not apply); checks the GPU code path of the ranks, not their scaling

The tiny BF16 Qwen3.5-MoE fixture is built here (transformers `save_pretrained`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = ["--samples", "8", "--seq-len", "64", "--batch-tokens", "128", "--quiet"]


def qtool(args: list, ranks: int, device: str, same_gpu: bool) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "qtool", *map(str, args), "--device", device]
    t0 = time.perf_counter()
    if ranks == 1:
        p = subprocess.run(base, capture_output=True, text=True, env=env)
        out = [p]
    elif not same_gpu:
        out = [subprocess.run([*base, "--nproc", str(ranks)], capture_output=True, text=True, env=env)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env |= {
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "QTOOL_DEVICES": ",".join([device if ":" in device or device == "cpu" else device + ":0"] * ranks),
        }
        procs = [
            subprocess.Popen(
                base,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(ranks)
        ]
        out = []
        for p in procs:
            o, e = p.communicate()
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    wall = time.perf_counter() - t0
    for p in out:
        if p.returncode != 0:
            raise SystemExit(
                f"{' '.join(map(str, args))} ({ranks} ranks) failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
            )
    return wall, out[0].stdout


def same_dirs(a: Path, b: Path) -> list[str]:
    diff = []
    for f in sorted(a.iterdir()):
        if f.name != "qtool-manifest.json" and f.read_bytes() != (b / f.name).read_bytes():
            diff.append(f.name)
    return diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--same-gpu", action="store_true")
    a = ap.parse_args()
    from qtool.fixtures import tiny

    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.workdir / "bf16"
    if not (src / "config.json").exists():
        tiny.build_bf16(src)
    bad = 0
    for name, args in (
        ("quantize nvfp4", ["quantize", src, "--recipe", "qwen35-nvfp4-experts", *JOB]),
        ("quantize awq", ["quantize", src, "--recipe", "qwen35-awq-int4", *JOB]),
        # every rank runs every window of a GPTQ layer: the ranks' GPUs must compute the same forward
        ("quantize gptq", ["quantize", src, "--recipe", "qwen35-nvfp4-experts-gptq", *JOB]),
    ):
        outs = {}
        for n in (1, a.nproc):
            outs[n] = a.workdir / f"{name.replace(' ', '-')}-{n}"
            wall, _ = qtool([*args, "-o", outs[n], "--force"], n, a.device, a.same_gpu)
            print(f"{name:16s} {n} rank(s): {wall:6.1f} s", flush=True)
        diff = same_dirs(outs[1], outs[a.nproc])
        bad += bool(diff)
        print(f"{name:16s} {'IDENTICAL' if not diff else 'DIFFERS: ' + ', '.join(diff)}")
    q = a.workdir / "quantize-nvfp4-1"
    outs = {}
    for n in (1, a.nproc):
        outs[n] = a.workdir / f"kv-{n}"
        wall, _ = qtool(
            ["calibrate-kv", q, "-o", outs[n], "--force", "--replace-scales", *JOB], n, a.device, a.same_gpu
        )
        print(f"calibrate-kv     {n} rank(s): {wall:6.1f} s", flush=True)
    diff = same_dirs(outs[1], outs[a.nproc])
    bad += bool(diff)
    print(f"calibrate-kv     {'IDENTICAL' if not diff else 'DIFFERS: ' + ', '.join(diff)}")
    res = {}
    for n in (1, a.nproc):
        wall, text = qtool(
            [
                "eval",
                "kld",
                "--ref",
                src,
                "--test",
                q,
                "--windows",
                "8",
                "--seq-len",
                "64",
                "--batch-tokens",
                "128",
                "--json",
                "--quiet",
            ],
            n,
            a.device,
            a.same_gpu,
        )
        res[n] = json.loads(text)
        print(f"eval kld         {n} rank(s): {wall:6.1f} s, mean KLD {res[n]['mean']:.6g}", flush=True)
    bad += res[1] != res[a.nproc]
    print(f"eval kld         {'IDENTICAL' if res[1] == res[a.nproc] else 'DIFFERS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
