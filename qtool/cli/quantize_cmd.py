"""qtool quantize SRC -o OUT --recipe RECIPE [--backend rtn|modelopt|llmcompressor]
[--format modelopt|compressed-tensors|awq] [--dataset builtin|FILE|hf:ORG/NAME[:SPLIT]] [--samples N] [--seq-len L]
[--device cpu|cuda[:N]] [--resume] [--force] [--dry-run] [--json] [--quiet]"""

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
from qtool.cli.sources import headers_checkpoint, local_checkpoint
from qtool.ops import quantize
from qtool.recipes import Backend, OutFormat, load_recipe


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="BF16 source checkpoint directory")
    p.add_argument("--recipe", required=True, help="shipped recipe name (see recipes/) or a YAML path")
    p.add_argument("--backend", choices=["rtn", "modelopt", "llmcompressor"], help="default: the recipe's")
    p.add_argument("--format", choices=["modelopt", "compressed-tensors", "awq"], help="default: the recipe's")
    p.add_argument("--dataset", default="builtin", help=DATASET_HELP)
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="calibration windows (default 16, or as many as a shorter dataset gives)",
    )
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_output_flags(p)
    add_parallel_flags(p)


def run(args) -> int:
    check_device(args.device, present=not args.dry_run)
    recipe = load_recipe(args.recipe)
    opts = quantize.QuantizeOptions(
        headers_checkpoint(args.checkpoint) if args.dry_run else local_checkpoint(args.checkpoint),
        out=args.output,
        recipe=recipe,
        backend=Backend(args.backend) if args.backend else None,
        format=OutFormat(args.format) if args.format else None,
        dataset=args.dataset,
        samples=args.samples,
        seq_len=args.seq_len,
        device=args.device,
        resume=args.resume,
        force=args.force,
        command=run_command_line(),
        batch_tokens=args.batch_tokens,
    )
    rep = plan_then_execute(quantize, opts, args, show_plan=_print_plan)
    if args.json:
        print_json(rep)
        return 0
    if args.dry_run:
        return 0
    for lr in rep["layers"]:
        t = lr["tokens_per_expert"]
        print(
            f"  layer {lr['layer']:>3} {lr['routed_experts']:>6}: tokens/expert min {min(t)} max {max(t)}"
            + _fallback(lr)
        )
    o = rep["output"]
    print(f"wrote {o['shards']} shards, {human_bytes(o['bytes'])} -> {o['output']} in {rep['seconds']:.1f} s")
    if o["problems"]:
        eprint(f"problems: {o['problems']}")
    for w in o["warnings"]:  # what the output check did not cover (engine rules qtool does not model)
        print(f"  warning      {w['code']}: {w['message']}")
    return 0


def _fallback(lr: dict) -> str:
    """The layer's experts below the token floor, and the rule they were coded by (qtool.ops.quantize.coverage)."""
    fallback, floor = lr["experts_fallback"], lr["min_expert_tokens"]
    if not fallback:
        return ""
    few = "saw none" if floor <= 1 else f"saw fewer than {floor} tokens"
    return f", {len(fallback)} expert(s) {few} (fallback {lr['fallback_rule']})"


def _print_plan(p: dict) -> None:
    m = p["memory"]
    print(f"{p['checkpoint']} -> {p['output']}")
    print(f"  recipe       {p['recipe']['name']} (backend {p['backend']}, format {p['format']})")
    schemes = {}
    for lp in p["layers"]:
        schemes.setdefault(lp["routed_experts"], []).append(lp["layer"])
    for s, ls in schemes.items():
        print(f"  experts      {s}: layers {ls[0]}..{ls[-1]} ({len(ls)})")
    c = p["calibration"]
    print(f"  calibration  {c['dataset']}: {c['samples']} x {c['seq_len']} tokens on {p['device']}" + dataset_supply(c))
    cover = p["recipe"]["expert_coverage"]
    print(
        f"  expert stats {cover['experts']} tokens; fewer than {cover['min_expert_tokens']} -> fallback layer_amax"
        if cover["min_expert_tokens"] > 1
        else f"  expert stats {cover['experts']} tokens; an expert that saw none -> fallback layer_amax"
    )
    files = m["hidden_disk_bytes"] // max(1, m["hidden_bytes"])
    print(
        f"  memory       one layer {human_bytes(m['max_layer_bytes'])}, "
        f"activations ~{human_bytes(m['activation_bytes'])}, "
        f"hidden states {human_bytes(m['hidden_bytes'])} x{files} on disk, "
        f"{m['layers_in_flight']} finished layer(s) written at once"
    )
    print(f"  peak memory  {memory_line(m['need'])}")
    print(f"  output       ~{human_bytes(p['output_bytes'])}")
    for w in p["warnings"]:
        print(f"  note         {w}")
