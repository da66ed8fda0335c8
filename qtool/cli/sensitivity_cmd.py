"""qtool sensitivity BF16 QUANTIZED -o OUT [--formats bf16,fp8,nvfp4[:METHOD]] [--dataset D] [--samples N]
[--seq-len L] [--device cpu|cuda] [--force] [--resume] [--dry-run] [--json] [--quiet]"""

from __future__ import annotations

from pathlib import Path

from qtool.cli.common import (
    DATASET_HELP,
    add_output_flags,
    check_batch_tokens,
    check_device,
    dataset_supply,
    human_bytes,
    layer_ranges,
    memory_line,
    plan_then_execute,
    print_json,
    run_command_line,
)
from qtool.cli.sources import headers_checkpoint, local_checkpoint
from qtool.ops import sensitivity
from qtool.ops.sensitivity.formats import parse_formats


def add_arguments(p) -> None:
    p.add_argument("bf16", help="the BF16 checkpoint (the reference)")
    p.add_argument("quantized", help="its quantized sibling (NVFP4 ModelOpt / compressed-tensors, AWQ / INT4)")
    p.add_argument(
        "--formats",
        default=None,
        metavar="F,F,...",
        help="also measure each layer unit in each of these formats (bf16, fp8, nvfp4 or nvfp4:METHOD with "
        "METHOD a recipe's nvfp4.weight_scale), for plan hybrid to pick one per unit (default: none)",
    )
    p.add_argument("--dataset", default="builtin", help=DATASET_HELP)
    p.add_argument("--samples", type=int, default=4, help="number of token windows (default 4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        metavar="T",
        help="tokens per micro-batch (default 4096 on CPU, 32768 on GPU)",
    )
    add_output_flags(p, output_help="output directory: OUT/sensitivity.json (+ manifest)")


def run(args) -> int:
    check_device(args.device, present=not args.dry_run)
    check_batch_tokens(args.batch_tokens)
    # --dry-run reads headers only, also of hf: sources; a real run needs both checkpoints' data
    src = headers_checkpoint if args.dry_run else local_checkpoint
    opts = sensitivity.SensitivityOptions(
        Path(src(args.bf16)),
        Path(src(args.quantized)),
        Path(args.output),
        dataset=args.dataset,
        samples=args.samples,
        seq_len=args.seq_len,
        device=args.device,
        batch_tokens=args.batch_tokens,
        force=args.force,
        resume=args.resume,
        command=run_command_line(),
        formats=None if args.formats is None else parse_formats(args.formats),
    )
    rep = plan_then_execute(sensitivity, opts, args, show_plan=_print_plan)
    if args.json:
        print_json(rep)
        return 0
    if args.dry_run:
        return 0
    if rep["timing"].get("resumed_from_layer"):
        print(f"  resumed        at layer {rep['timing']['resumed_from_layer']}")
    print(f"  {'unit':<28} {'format':<8} {'error':>10} {'effect':>10} {'BF16':>10} {'quantized':>10}")
    for u in rep["table"]["units"]:
        if u["measured"]:
            print(
                f"  {u['id']:<28} {u['quantized_format']:<8} {u['error']:>10.3e} {u['effect']:>10.3e} "
                f"{human_bytes(u['bf16_bytes']):>10} {human_bytes(u['quantized_bytes']):>10}"
            )
    for u in rep["table"]["units"]:
        for fmt, row in (u.get("formats") or {}).items():
            if fmt != "bf16":
                print(
                    f"  {u['id']:<28} {fmt:<8} {row['error']:>10.3e} {row['effect']:>10.3e} "
                    f"{human_bytes(u['bf16_bytes']):>10} {human_bytes(row['bytes']):>10}"
                )
    print(
        f"wrote {rep['output']}/sensitivity.json ({rep['seconds']:.1f} s); next: qtool plan hybrid "
        f"--sensitivity {rep['output']} --gpus ... --tp ... --max-model-len ..."
    )
    return 0


def _print_plan(p: dict) -> None:
    c = p["calibration"]
    print(f"{p['bf16']} vs {p['quantized']} -> {p['output']}")
    print(f"  units          {p['units']}, measured {len(p['measured'])}:")
    kinds: dict[str, list[int]] = {}
    for uid in p["measured"]:
        kinds.setdefault(uid.split(".")[-1], []).append(int(uid.split(".")[1]))
    for kind, layers in kinds.items():
        print(f"    {kind:<16} layers {layer_ranges(layers)}")
    print(
        f"  calibration    {c['dataset']}: {c['samples']} x {c['seq_len']} = {c['tokens']} tokens on {p['device']}"
        + dataset_supply(c)
    )
    m = p["memory"]
    print(
        f"  memory         a layer of each side dense "
        f"({human_bytes(m['max_layer_bytes'])} each, {m['compute_dtype']}), "
        f"activations ~{human_bytes(m['activation_bytes'])} ({m['batch_windows']} windows/batch)"
    )
    print(f"                 hidden states {human_bytes(m['hidden_bytes'])} x2 on disk in {p['work_dir']}")
    print(f"  peak memory    {memory_line(m['need'])}")
    if "formats" in p:
        f = p["formats"]
        print(f"  formats        {', '.join(f['candidates'])} (nvfp4 block scales: {f['nvfp4']['weight_scale']})")
        for fmt, ids in f["measured"].items():
            print(f"    {fmt:<16} {len(ids)} unit(s)")
    for w in p["warnings"]:
        print(f"  note           {w}")
