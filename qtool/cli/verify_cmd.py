"""qtool verify CKPT [--engine vllm|sglang|both|vllm@0.17] [--tp 4] [--gpus 4x97887MiB] [--max-model-len N]
[--max-num-seqs N] [--kv-cache-dtype auto|fp8] [--gpu-memory-utilization F] [--mtp N] [--deep] [--json]"""

from __future__ import annotations

from qtool.cli.common import STAND_INS, add_json_flag, as_user_named, number, print_json
from qtool.cli.sources import headers_checkpoint, local_checkpoint
from qtool.ops.verify import VerifyOptions, verify

MAX_PER_CODE = 5


def add_common(p) -> None:
    """Flags shared with serve-config (which verifies first)."""
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default 4)")
    p.add_argument(
        "--gpus",
        default="4x97887MiB",
        help="GPUs as NxSIZE (MiB, GiB or GB); default 4x97887MiB = 4 x RTX PRO 6000 Blackwell",
    )
    p.add_argument("--max-model-len", type=int, default=None, metavar="N", help="context length to check")
    p.add_argument(
        "--max-num-seqs", type=number(int, low=1), default=None, metavar="N", help="concurrent sequences to check"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default=None,
        help="KV cache dtype (default: fp8 where every full-attention layer has calibrated k/v "
        "scales, else auto = BF16, as the launch serves it)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=number(float, low=0, high=1, low_open=True),
        default=0.9,
        metavar="F",
        help="fraction of each GPU the engine may use (default 0.9)",
    )
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="speculative tokens from the MTP head (0: off; more than 3 is unstable, a warning)",
    )


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument(
        "--engine",
        default="both",
        help="vllm, sglang, both (default), or version specs, e.g. vllm@0.17 or vllm@0.16,sglang@0.5.9",
    )
    add_common(p)
    p.add_argument(
        "--deep",
        action="store_true",
        help="also sha256 every shard and scan the data for NaN/Inf, "
        "bad scales and all-zero tensors (reads every byte)",
    )
    p.add_argument("--workers", type=int, default=None, help="parallel readers for --deep (default: auto)")
    add_json_flag(p)


def options(args, engine: str):
    return VerifyOptions(
        engine=engine,
        tp=args.tp,
        gpus=args.gpus,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        gpu_memory_utilization=args.gpu_memory_utilization,
        mtp=args.mtp,
        deep=getattr(args, "deep", False),
        deep_workers=getattr(args, "workers", None),
    )


def print_report(rep, out) -> None:
    counts: dict[str, int] = {}
    for f in rep.findings:
        counts[f.code.value] = counts.get(f.code.value, 0) + 1
        if counts[f.code.value] > MAX_PER_CODE:
            continue
        where = f" {f.module}" if f.module else ""
        eng = f" [{f.engine}]" if f.engine else ""
        print(f"{f.severity.value:>7} {f.code.value}{eng}:{where}", file=out)
        print(f"          {f.message}", file=out)
        if f.fix:
            print(f"     fix: {f.fix}", file=out)
    for code, n in counts.items():
        if n > MAX_PER_CODE:
            print(f"          ... {n - MAX_PER_CODE} more {code} (--json lists all)", file=out)


def print_fit(fit, out) -> None:
    if fit is None:
        return
    gb = fit.budget_gib * (1 << 30) / 1e9
    parts = f"weights {fit.weights_per_gpu_gib:.1f} GiB + reserve {fit.reserve_gib:.1f} GiB"
    if fit.kv_cache_gib > 0:
        split = f"= {parts} + KV/state {fit.kv_cache_gib:.1f} GiB"
    else:  # the weights and the reserve alone are over the budget: nothing is left for the KV cache
        split = f"< {parts} = {fit.weights_per_gpu_gib + fit.reserve_gib:.1f} GiB (nothing left for KV/state)"
    print(f"fit (TP={fit.tp}, per GPU): budget {fit.budget_gib:.1f} GiB ({gb:.1f} GB) {split}", file=out)
    print(
        f"  KV {fit.kv_bytes_per_token} B/token ({fit.kv_cache_dtype}), GDN state {fit.state_bytes_per_seq / 2**20:.1f}"
        f" MiB/sequence -> max_model_len {fit.max_model_len} x max_num_seqs {fit.max_num_seqs}: "
        f"{'fits' if fit.fits else 'DOES NOT FIT'}",
        file=out,
    )


def _verdict(rep, n_err: int) -> str:
    """The last line. An `ok` never claims what was not checked: the engine rules qtool does not model (an
    AutoAWQ, fp8 or GPTQ config; SGLang's MIXED_PRECISION) are named in it (the exit code stays 0: a warning)."""
    if not rep.ok:
        return f"FAILED: {n_err} error(s)"
    unchecked = [eng for eng, s in rep.engines.items() if s.get("modelled") is False]
    if not unchecked:
        return "ok"
    engines = ", ".join(unchecked)
    return f"ok, except what was NOT checked: which modules {engines} load quantized (engine-rules-not-modelled)"


def run(args) -> int:
    import sys

    ckpt = local_checkpoint(args.checkpoint, progress=False) if args.deep else headers_checkpoint(args.checkpoint)
    rep = verify(ckpt, options(args, args.engine))
    if str(ckpt) in STAND_INS:  # an hf: source read header-only: findings and fixes name the source
        import dataclasses

        rep.path = STAND_INS[str(ckpt)]
        rep.findings = [
            dataclasses.replace(f, message=as_user_named(f.message), fix=as_user_named(f.fix)) for f in rep.findings
        ]
    if args.json:
        print_json(rep.to_json())
    else:
        print(rep.path)
        print_report(rep, sys.stdout)
        print_fit(rep.fit, sys.stdout)
        if rep.engines:
            for eng, s in rep.engines.items():
                if "units" in s:
                    print(
                        f"{eng}: {s['quantized']} unit(s) quantized, {s['excluded']} excluded, {s['errors']} error(s)"
                    )
                elif s.get("modelled") is False:
                    print(f"{eng}: NOT checked: which modules it loads quantized (rules for this config not modelled)")
        if rep.deep:
            d = rep.deep
            # d["shards"] holds every file hashed: the shards and the manifest's other files (configs, tokenizer)
            shards = sum(name.endswith(".safetensors") for name in d["shards"])
            others = len(d["shards"]) - shards
            print(
                f"deep: {shards} shard(s)"
                + (f" and {others} other file(s)" if others else "")
                + f", {d['bytes'] / 1e9:.2f} GB in {d['seconds']:.1f} s "
                f"({d['gb_per_s']:.2f} GB/s), {d['compared_with_manifest']} compared with qtool-manifest.json"
            )
        n_err = len(rep.errors())
        print(_verdict(rep, n_err))
    return 0 if rep.ok else 3
