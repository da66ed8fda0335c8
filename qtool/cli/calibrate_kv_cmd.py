"""qtool calibrate-kv CKPT (-o OUT | --in-place) [--dataset builtin|FILE|hf:ORG/NAME[:SPLIT]] [--samples N]
[--seq-len L] [--device cpu|cuda|cuda:N] [--replace-scales] [--force] [--resume] [--dry-run] [--json] [--quiet]"""

from __future__ import annotations

from qtool.cli.common import (
    DATASET_HELP,
    add_output_flags,
    add_parallel_flags,
    check_device,
    dataset_supply,
    eprint,
    human_bytes,
    memory_line,
    plan_then_execute,
    print_json,
    run_command_line,
)
from qtool.cli.sources import headers_checkpoint, local_checkpoint, local_only
from qtool.errors import UsageError
from qtool.ops import calibrate_kv


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (BF16, NVFP4 ModelOpt/compressed-tensors, AWQ, FP8)")
    p.add_argument(
        "--in-place", action="store_true", help="add the scales to CKPT itself (built beside it, swapped in atomically)"
    )
    p.add_argument("--dataset", default="builtin", help=DATASET_HELP)
    p.add_argument("--samples", type=int, default=4, help="number of token windows (default 4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--replace-scales", action="store_true", help="replace the KV scales the checkpoint already has")
    add_output_flags(
        p,
        output="optional",
        output_help="write a new checkpoint directory (unchanged shards linked, never written through)",
    )
    add_parallel_flags(p)


def run(args) -> int:
    if bool(args.output) == bool(args.in_place):
        raise UsageError("say where to write: -o OUT or --in-place (one of them)")
    check_device(args.device, present=not args.dry_run)
    opts = calibrate_kv.CalibrateKvOptions(
        local_only(args.checkpoint)
        if args.in_place
        else (headers_checkpoint(args.checkpoint) if args.dry_run else local_checkpoint(args.checkpoint)),
        out=args.output,
        dataset=args.dataset,
        samples=args.samples,
        seq_len=args.seq_len,
        device=args.device,
        replace_scales=args.replace_scales,
        force=args.force,
        resume=args.resume,
        command=run_command_line(),
        batch_tokens=args.batch_tokens,
    )
    rep = plan_then_execute(calibrate_kv, opts, args, show_plan=_print_plan)
    if args.json:
        print_json(rep)
        return 0
    if args.dry_run:
        return 0
    print("  layer   tokens     k_amax    k_scale     v_amax    v_scale")
    for s in rep["layers"]:
        print(
            f"  {s['layer']:>5} {s['tokens']:>8} {s['k_amax']:>10.4g} {s['k_scale']:>10.4g} "
            f"{s['v_amax']:>10.4g} {s['v_scale']:>10.4g}"
        )
    t = rep["timing"]
    tps = f"{t['tokens_per_s']:.1f}" if t["tokens_per_s"] else "?"
    print(
        f"  {rep['calibration']['tokens']} tokens, {t['seconds']:.1f} s, {tps} tokens/s"
        + (f" (resumed at layer {t['resumed_from_layer']})" if t["resumed_from_layer"] else "")
    )
    for w in rep["warnings"]:
        if w not in rep["plan"]["warnings"]:  # the plan's were printed with it, before the work
            eprint(f"warning: {w}")
    o = rep["output"]
    print(f"wrote {o['new_shard']} and {', '.join(o['configs']) or 'no config'} -> {o['output']}")
    return 0


def _print_plan(p: dict) -> None:
    m = p["memory"]
    c = p["calibration"]
    print(f"{p['checkpoint']} -> {p['output']}")
    print(f"  convention     {p['convention']} ({len(p['scale_tensors'])} scale tensors in {p['new_shard']})")
    print(
        f"  layers         full attention {p['full_attention_layers']}; decoder layers run: {p['decoder_layers_run']}"
    )
    print(
        f"  calibration    {c['dataset']}: {c['samples']} x {c['seq_len']} = {c['tokens']} tokens on {p['device']}"
        + dataset_supply(c)
    )
    print(
        f"  memory         one layer {human_bytes(m['max_layer_bytes'])} ({m['compute_dtype']}), "
        f"embedding {human_bytes(m['embed_bytes'])}, activations ~{human_bytes(m['activation_bytes'])} "
        f"({m['batch_windows']} windows/batch)"
    )
    print(f"                 hidden states {human_bytes(m['hidden_bytes'])} x2 on disk in {p['work_dir']}")
    print(f"  peak memory    {memory_line(m['need'])}")
    for ch in p["config_changes"]:
        print(f"  config         {ch}")
    if p["replaces"]:
        print(
            f"  replaces       {len(p['replaces'])} existing scale tensor(s); "
            f"rewrites {p['rewrites_shards'] or 'no shard'}"
        )
    for w in p["warnings"]:
        print(f"  note           {w}")
