"""Quality of 4-bit routed experts on the trained proxy (qtool.fixtures.proxy), qtool next to its peers.

Every method quantizes only the routed experts of the same BF16 proxy (everything else BF16, no KV
scales) on the same calibration windows (calibration.txt), and is measured as mean KL divergence against
the BF16 proxy on the same held-out windows (heldout.txt) with `qtool eval kld` (weights only: the
evaluation dequantizes the stored weights, activations stay BF16). Each row also gives the routed experts'
bytes on disk (codes and every scale) and the quantize command's wall and CPU seconds. The baseline is
measured in the same run: qtool's NVFP4 RTN from max (ModelOpt's default numerics); each KLD is given as
a ratio to it. A peer backend that fails is left out of the table with its reason. The rows whose backend
is `oneshot` are llm-compressor's own GPTQ / AWQ pipeline instead of `qtool quantize`
(benchmarks/llmc_oneshot.py: same calibration token ids, same evaluation).

    python benchmarks/bench_quality.py --workdir /tmp/bq --out quality.json
    python benchmarks/bench_quality.py --workdir /tmp/bq --smoke        # tiny counts, for CI

INT4 uses group 32 by default: 4 bits + one BF16 scale per 32 weights = 4.5 bits, NVFP4's 4 bits + one
FP8 scale per 16 (equal bytes; `--int4-group-size 128` for the shipped AWQ recipe's group).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.fixtures.proxy import proxy_checkpoint  # noqa: E402 (after sys.path: the checkout's qtool)
from qtool.io.safetensors_header import read_header  # noqa: E402

BASELINE = "nvfp4-max"


@dataclass(frozen=True)
class Method:
    key: str
    label: str  # the method, as the table names it
    tool: str  # whose implementation
    backend: str  # qtool quantize --backend
    recipe: str  # YAML body (without schema/name lines)
    cuda_only: bool = False  # run by default only with --device cuda (named in --methods, it runs anyway)
    oneshot: tuple[str, ...] = ()  # llm-compressor's own pipeline instead of qtool quantize: llmc_oneshot.py's flags
    by_default: bool = True  # False: a diagnosis row, run only when named in --methods


GPTQ = "gptq: {enabled: true}\n"  # damp 0.01, block 128, no act order (the recipe's defaults)
GPTQ_UPDATED = "gptq: {enabled: true, scales: updated}\n"  # each block scale chosen as GPTQ reaches it


def _nvfp4(weight_scale: str, gptq: bool = False, updated: bool = False) -> str:
    return (
        f"groups: {{routed_experts: nvfp4}}\nnvfp4: {{weight_scale: {weight_scale}}}\ndefaults: {{format: modelopt}}\n"
        + (GPTQ_UPDATED if updated else GPTQ if gptq else "")
    )


def _int4(group_size: int, awq: bool, gptq: bool = False) -> str:
    # no layer overrides: every decoder layer's experts INT4 (the shipped AWQ recipe keeps layer 0 BF16)
    return (
        f"groups: {{routed_experts: w4a16}}\nint4: {{group_size: {group_size}, awq: {str(awq).lower()}}}\n"
        "defaults: {format: compressed-tensors}\n" + (GPTQ if gptq else "")
    )


def _v2_mixed() -> str:
    # nvidia's NVFP4-V2 mix (the shipped qwen35-nvfp4-v2 without KV scales): its rest FP8 instead of BF16
    return (
        "groups: {routed_experts: nvfp4, attention: fp8, shared_expert: fp8, linear_attn: fp8}\n"
        "nvfp4: {weight_scale: mse_sweep}\ndefaults: {format: modelopt}\n"
    )


def methods(int4_group: int) -> list[Method]:
    return [
        Method("nvfp4-max", "NVFP4 RTN, block scale from max", "qtool", "rtn", _nvfp4("max")),
        Method("nvfp4-mse", "NVFP4, block scale MSE (7 shrinks)", "qtool", "rtn", _nvfp4("mse")),
        Method("nvfp4-mse-sweep", "NVFP4, block scale MSE (126 E4M3 sweep)", "qtool", "rtn", _nvfp4("mse_sweep")),
        Method("nvfp4-4over6", "NVFP4, block max to 6 or 4 (four-over-six)", "qtool", "rtn", _nvfp4("four_over_six")),
        Method(
            "nvfp4-local-hessian",
            "NVFP4, block scale by local Hessian (126 E4M3 sweep, dwᵀ H dw)",
            "qtool",
            "rtn",
            _nvfp4("local_hessian"),
        ),
        Method("nvfp4-max-gptq", "NVFP4 GPTQ, block scale from max", "qtool", "rtn", _nvfp4("max", gptq=True)),
        Method(
            "nvfp4-mse-sweep-gptq", "NVFP4 GPTQ, block scale MSE sweep", "qtool", "rtn", _nvfp4("mse_sweep", gptq=True)
        ),
        Method(
            "nvfp4-max-gptq-updated",
            "NVFP4 GPTQ, block scale from the updated block's max",
            "qtool",
            "rtn",
            _nvfp4("max", updated=True),
        ),
        Method(
            "nvfp4-mse-sweep-gptq-updated",
            "NVFP4 GPTQ, block scale MSE sweep of the updated block",
            "qtool",
            "rtn",
            _nvfp4("mse_sweep", updated=True),
        ),
        Method(
            "nvfp4-local-hessian-gptq",
            "NVFP4 GPTQ, block scale by local Hessian of the updated block (dwᵀ S dw)",
            "qtool",
            "rtn",
            _nvfp4("local_hessian", updated=True),
        ),
        Method("int4-rtn", f"INT4 W4A16 g{int4_group} RTN", "qtool", "rtn", _int4(int4_group, awq=False)),
        Method("int4-awq", f"INT4 W4A16 g{int4_group} AWQ", "qtool", "rtn", _int4(int4_group, awq=True)),
        Method("int4-gptq", f"INT4 W4A16 g{int4_group} GPTQ", "qtool", "rtn", _int4(int4_group, awq=False, gptq=True)),
        Method(
            "int4-awq-gptq", f"INT4 W4A16 g{int4_group} AWQ + GPTQ", "qtool", "rtn", _int4(int4_group, True, gptq=True)
        ),
        Method("modelopt-nvfp4-max", "NVFP4 RTN, block scale from max", "ModelOpt", "modelopt", _nvfp4("max")),
        # ModelOpt's static NVFP4 fake-quant is a Triton kernel: its searched rows need --device cuda
        Method(
            "modelopt-nvfp4-local-hessian",
            "NVFP4, block scale by local Hessian",
            "ModelOpt",
            "modelopt",
            _nvfp4("local_hessian"),
            cuda_only=True,
        ),
        Method("llmc-nvfp4-minmax", "NVFP4 RTN, minmax observer", "llm-compressor", "llmcompressor", _nvfp4("max")),
        Method("llmc-nvfp4-mse", "NVFP4, mse observer", "llm-compressor", "llmcompressor", _nvfp4("mse")),
        # llm-compressor's GPTQModifier end to end (oneshot), not through qtool: benchmarks/llmc_oneshot.py
        Method(
            "llmc-nvfp4-gptq",
            "NVFP4 GPTQ (GPTQModifier)",
            "llm-compressor",
            "oneshot",
            "",
            oneshot=("--scheme", "nvfp4"),
        ),
        Method(
            "llmc-nvfp4-gptq-bf16-propagation",
            "NVFP4 GPTQ (GPTQModifier), each layer calibrated on BF16 activations as qtool does",
            "llm-compressor",
            "oneshot",
            "",
            oneshot=("--scheme", "nvfp4", "--bf16-propagation"),
            by_default=False,  # explains the gap between the two GPTQ rows; not a method of its own
        ),
        Method(
            "llmc-int4-gptq",
            f"INT4 W4A16 g{int4_group} GPTQ (GPTQModifier)",
            "llm-compressor",
            "oneshot",
            "",
            oneshot=("--scheme", "w4a16", "--group-size", str(int4_group)),
        ),
        Method(
            "llmc-int4-awq-gptq",
            f"INT4 W4A16 g{int4_group} AWQ + GPTQ (AWQModifier, GPTQModifier)",
            "llm-compressor",
            "oneshot",
            "",
            oneshot=("--scheme", "w4a16", "--group-size", str(int4_group), "--awq"),
        ),
        Method("v2-mixed", "NVFP4 sweep experts + FP8 rest (NVFP4-V2)", "qtool", "rtn", _v2_mixed()),
    ]


def write_recipe(method: Method, workdir: Path) -> Path:
    path = workdir / "recipes" / f"{method.key}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"schema_version: 1\nname: bench-{method.key}\nkv_cache: none\n{method.recipe}", encoding="utf-8")
    return path


def ensure_proxy(workdir: Path) -> Path:
    """The BF16 proxy checkpoint, built once per workdir (heldout.txt is its last file)."""
    src = workdir / "bf16"
    if not (src / "heldout.txt").exists():
        proxy_checkpoint(ROOT / "benchmarks/proxy", src, force=True)
    return src


def qtool(args: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `qtool ARGS` from this tree: (the process, wall seconds, CPU seconds of the child)."""
    return timed([sys.executable, "-m", "qtool", *args])


def timed(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run CMD from this tree: (the process, wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=_env())
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


def _env() -> dict[str, str]:
    """The caller's environment with this tree first on the path (a PYTHONPATH it had stays after it: where
    the peer libraries were installed beside the system's, e.g. with pip --target)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}


def expert_tensors(ckpt: Path) -> dict[str, tuple[str, int, int]]:
    """Routed-expert tensors of the decoder layers (not the MTP head's): name -> (file, start, end)."""
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        for name, info in read_header(shard).tensors.items():
            if ".layers." in name and ".mlp.experts." in name and not name.startswith("mtp."):
                out[name] = (info.file, info.start, info.end)
    return out


def weight_bytes(ckpt: Path) -> int:
    """Every tensor's bytes on disk (the experts and the rest: where a mixed recipe saves its bytes)."""
    return sum(
        info.end - info.start for shard in ckpt.glob("*.safetensors") for info in read_header(shard).tensors.values()
    )


def expert_bytes(ckpt: Path) -> int:
    return sum(end - start for _, start, end in expert_tensors(ckpt).values())


def same_expert_bytes(a: Path, b: Path) -> bool:
    ta, tb = expert_tensors(a), expert_tensors(b)
    if ta.keys() != tb.keys():
        return False
    return all(_read(*ta[n]) == _read(*tb[n]) for n in ta)


def _read(file: str, start: int, end: int) -> bytes:
    with open(file, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def quantize(method: Method, src: Path, out: Path, workdir: Path, a: argparse.Namespace):
    """The method's quantized checkpoint at OUT: (the process, wall seconds, CPU seconds)."""
    if method.oneshot:
        return timed(
            [
                sys.executable,
                str(ROOT / "benchmarks/llmc_oneshot.py"),
                str(src),
                str(out),
                *method.oneshot,
                "--samples",
                str(a.calib_samples),
                "--seq-len",
                str(a.seq_len),
            ]
        )
    recipe = write_recipe(method, workdir)
    return qtool(
        [
            "quantize",
            str(src),
            "-o",
            str(out),
            "--recipe",
            str(recipe),
            "--backend",
            method.backend,
            "--dataset",
            str(src / "calibration.txt"),
            "--samples",
            str(a.calib_samples),
            "--seq-len",
            str(a.seq_len),
            "--device",
            a.device,
            "--force",
            "--quiet",
        ]
    )


def run_method(method: Method, src: Path, workdir: Path, a: argparse.Namespace) -> dict:
    out = workdir / "out" / method.key
    proc, wall, cpu = quantize(method, src, out, workdir, a)
    if proc.returncode != 0:
        return {"key": method.key, "error": f"quantize exit {proc.returncode}: {_last_line(proc)}"}
    kld, _, _ = qtool(
        [
            "eval",
            "kld",
            "--ref",
            str(src),
            "--test",
            str(out),
            "--dataset",
            str(src / "heldout.txt"),
            "--windows",
            str(a.eval_windows),
            "--seq-len",
            str(a.seq_len),
            "--device",
            a.device,
            "--json",
            "--quiet",
        ]
    )
    if kld.returncode != 0:
        return {"key": method.key, "error": f"eval kld exit {kld.returncode}: {_last_line(kld)}"}
    stats = json.loads(kld.stdout)
    return {
        "key": method.key,
        "method": method.label,
        "tool": method.tool,
        "backend": method.backend,
        "mean_kld": stats["mean"],
        "p99_kld": stats["p99"],
        "top1_agreement": stats["top1_agreement"],
        "positions": stats["positions"],
        "expert_bytes": expert_bytes(out),
        "weight_bytes": weight_bytes(out),
        "quantize_wall_s": round(wall, 2),
        "quantize_cpu_s": round(cpu, 2),
        "out": str(out),
    }


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else "(no output)"


def table(rows: list[dict]) -> str:
    base = next((r["mean_kld"] for r in rows if r["key"] == BASELINE), math.nan)
    lines = [
        "| method | tool | mean KLD | ratio to qtool NVFP4 max "
        "| expert bytes | all weight bytes | quantize s (wall / CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['tool']} | {r['mean_kld']:.4g} | {r['mean_kld'] / base:.3f} | "
            f"{r['expert_bytes']:,} | {r['weight_bytes']:,} | {r['quantize_wall_s']:.1f} / {r['quantize_cpu_s']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True, help="the proxy checkpoint (cached) and the outputs")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--calib-samples", type=int, default=16, help="calibration windows (default 16)")
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows for eval kld (default 16)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window, both (default 256)")
    ap.add_argument("--int4-group-size", type=int, default=32, help="INT4 group (default 32: NVFP4's bytes)")
    ap.add_argument(
        "--methods",
        help="comma-separated keys (default: all but the diagnosis rows, and on a CPU the CUDA-only ones): "
        + ",".join(m.key for m in methods(32)),
    )
    ap.add_argument("--device", default="cpu", help="quantize and eval kld on this device (default cpu)")
    ap.add_argument("--smoke", action="store_true", help="2 windows of 64 tokens each side (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.calib_samples, a.eval_windows, a.seq_len = 2, 2, 64
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    chosen = methods(a.int4_group_size)
    if a.methods:
        keys = a.methods.split(",")
        unknown = sorted(set(keys) - {m.key for m in chosen})
        if unknown:
            print(f"unknown --methods {','.join(unknown)}; known: {','.join(m.key for m in chosen)}", file=sys.stderr)
            return 2
        chosen = [m for m in chosen if m.key in keys]
    else:
        chosen = [m for m in chosen if m.by_default and (a.device.startswith("cuda") or not m.cuda_only)]
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = ensure_proxy(a.workdir)
    rows, failed = [], []
    for method in chosen:
        print(f"{method.key} ...", flush=True)
        row = run_method(method, src, a.workdir, a)
        (failed if "error" in row else rows).append(row)
        if "error" in row:
            print(f"  left out: {row['error']}", flush=True)
    print(f"\n{a.calib_samples} x {a.seq_len} calibration tokens, {a.eval_windows} x {a.seq_len} held-out tokens\n")
    print(table(rows))
    by_key = {r["key"]: r for r in rows}
    if BASELINE in by_key and "modelopt-nvfp4-max" in by_key:
        same = same_expert_bytes(Path(by_key[BASELINE]["out"]), Path(by_key["modelopt-nvfp4-max"]["out"]))
        print(f"\nModelOpt's routed experts byte-identical to qtool NVFP4 max: {'yes' if same else 'NO'}")
        by_key["modelopt-nvfp4-max"]["experts_identical_to_qtool_max"] = same
    for row in failed:
        print(f"left out {row['key']}: {row['error']}")
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "calib": [a.calib_samples, a.seq_len],
                    "eval": [a.eval_windows, a.seq_len],
                    "rows": rows,
                    "failed": failed,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
