"""qtool plan hybrid --sensitivity S [--gpus 4x97887MiB] [--tp 4] [--max-model-len N] [--max-num-seqs N]
[--kv-cache-dtype auto|fp8] [--mtp N] [--engine both] [--max-weights-gib G] [-o RECIPE.yaml] [--force] [--json]"""

from __future__ import annotations

from pathlib import Path

from qtool.cli.common import add_json_flag, layer_ranges, number, path_arg, print_json
from qtool.cli.verify_cmd import add_common
from qtool.errors import UsageError
from qtool.ops.sensitivity.plan_formats import FormatChoice
from qtool.ops.sensitivity.plan_hybrid import MAX_WEIGHTS_GIB, PlanHybridOptions, plan, write_recipe
from qtool.sizes import human_bytes

LIST_AT_MOST = 20  # chosen units listed one per line up to this many


def _by_kind(chosen: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in chosen:
        out.setdefault(c["id"].split(".")[-1], []).append(c)
    return out


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="kind", metavar="KIND")
    h = sub.add_parser(
        "hybrid",
        help="the BF16 units that buy the most quality in the memory left, from a "
        "sensitivity table; writes a build recipe",
        description="Pick the BF16 units (a layer's routed experts, a layer's shared expert) that "
        "remove the most measured error within what verify's memory fit leaves at the target; "
        "print the plan and write a build recipe (-o). See docs/plan-hybrid.md.",
    )
    h.add_argument(
        "--sensitivity", required=True, type=path_arg, metavar="S", help="qtool sensitivity's output (OUT or its JSON)"
    )
    add_common(h)  # the serving target, with verify's flags and defaults
    h.add_argument("--engine", default="both", help="the engines the recipe's verify step checks (default both)")
    h.add_argument(
        "--max-weights-gib",
        type=number(float, low=0, high=MAX_WEIGHTS_GIB, low_open=True),
        default=None,
        metavar="G",
        help="budget the weights per GPU directly (instead of the memory fit's headroom)",
    )
    h.add_argument(
        "--quantized", default=None, type=path_arg, metavar="PATH", help="the quantized checkpoint, if moved since"
    )
    h.add_argument("--bf16", default=None, type=path_arg, metavar="PATH", help="the BF16 checkpoint, if moved since")
    h.add_argument(
        "-o", "--output", default=None, type=path_arg, metavar="RECIPE.yaml", help="write the build recipe here"
    )
    h.add_argument(
        "--formats",
        default=None,
        metavar="F,F,...",
        help="a table measured with --formats: the formats to pick from, one per unit (default: all it "
        "measured); -o then writes a quantization recipe",
    )
    h.add_argument("--force", action="store_true", help="replace a recipe this command wrote")
    h.add_argument("--name", default=None, help="the recipe's name (default planned-hybrid)")
    h.add_argument("--dry-run", action="store_true", help="print the plan and its memory fit; write no recipe")
    h.add_argument("--quiet", action="store_true", help="no progress bars (it shows none: for scripts' uniformity)")
    add_json_flag(h)


def run(args) -> int:
    if getattr(args, "kind", None) != "hybrid":
        raise UsageError("plan needs a kind", expected="qtool plan hybrid --sensitivity S ...")

    opts = PlanHybridOptions(
        Path(args.sensitivity),
        gpus=args.gpus,
        tp=args.tp,
        max_model_len=args.max_model_len,
        max_num_seqs=1 if args.max_num_seqs is None else args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        mtp=args.mtp,
        engine=args.engine,
        max_weights_gib=args.max_weights_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantized=None if args.quantized is None else Path(args.quantized),
        bf16=None if args.bf16 is None else Path(args.bf16),
        out=None if args.output is None else Path(args.output),
        force=args.force,
        name=args.name,
        dry_run=args.dry_run,
        formats=args.formats,
    )
    choice = plan(opts)
    written = opts.out is not None and not opts.dry_run
    if written:
        write_recipe(choice, opts.out)
    rep = choice.to_json()
    if args.json:
        print_json({**rep, "dry_run": opts.dry_run, "recipe": str(opts.out) if written else None})
        return 0
    if isinstance(choice, FormatChoice):
        _print_formats(rep, opts, written)
        return 0
    _print_head(rep, opts)
    print(
        f"  budget         {human_bytes(rep['budget_bytes_per_gpu'])} per GPU for BF16 units"
        + (" (--max-weights-gib" if opts.max_weights_gib is not None else " (what the memory fit leaves")
        + (", less the fixed costs above)" if rep["fixed"] else ")")
    )
    print(f"  chosen         {len(rep['chosen'])} unit(s), {human_bytes(rep['used_bytes_per_gpu'])} per GPU:")
    if len(rep["chosen"]) <= LIST_AT_MOST:
        for c in rep["chosen"]:
            print(f"    {c['id']:<28} +{human_bytes(c['extra_bytes_per_gpu']):>10}  gain {c['gain']:.3g}")
    else:  # a 397B plan chooses dozens: one line per kind of unit (--json lists each)
        for kind, cs in _by_kind(rep["chosen"]).items():
            print(
                f"    {kind:<16} layers {layer_ranges([int(c['id'].split('.')[1]) for c in cs])}: {len(cs)} unit(s), "
                f"+{human_bytes(sum(c['extra_bytes_per_gpu'] for c in cs))}, gain {sum(c['gain'] for c in cs):.3g}"
            )
    pe = rep["predicted_error"]
    print(f"  predicted      error {pe['planned']:.3g} (the quantized checkpoint: {pe['quantized']:.3g})")
    hp = rep["hand_picked"]
    if hp["units"]:
        print(
            f"  hand-picked    BF16 shared experts: +{human_bytes(hp['extra_bytes_per_gpu'])} per GPU, error "
            f"{hp['predicted_error']:.3g}" + ("" if hp["fits"] else " (does not fit)")
        )
    print(f"  headroom       {human_bytes(rep['headroom_bytes_per_gpu'])} per GPU left")
    if rep["next"]:
        n = rep["next"]
        print(
            f"  next           {n['id']} would cost +{human_bytes(n['extra_bytes_per_gpu'])} per GPU "
            f"(gain {n['gain']:.3g})"
        )
    for note in rep["notes"]:
        print(f"  note           {note}")
    if written:
        print(f"wrote {opts.out}; build it: qtool build {opts.out} -o OUT")
    elif opts.dry_run:
        print("dry run: no recipe written")
    return 0


def _print_head(rep: dict, opts: PlanHybridOptions) -> None:
    """The target, the memory fit it budgets from and the fixed costs (both kinds of plan)."""
    t = rep["target"]
    print(
        f"plan: {rep['quantized']} on {t['gpus']}, TP={t['tp']}, {t['max_num_seqs']} x {t['max_model_len']} tokens, "
        f"KV {t['kv_cache_dtype']}" + (f", MTP {t['mtp']}" if t["mtp"] else "")
    )
    u = {k: human_bytes(v * 2**30) for k, v in rep["fit"]["usage_gib"].items()}
    print(
        f"  memory fit     per GPU of {human_bytes(rep['fit']['budget_gib'] * 2**30)}: weights {u['weights']}, "
        f"KV cache {u['kv_cache']}, GDN state {u['gdn_state']}, reserve {u['reserve']}, unused {u['unused']}"
    )
    for f in rep["fixed"]:
        print(f"  fixed          {f['what']}: {human_bytes(f['bytes_per_gpu'])} per GPU")


def _signed_bytes(n: float) -> str:
    return ("+" if n >= 0 else "-") + human_bytes(abs(n))


def _print_formats(rep: dict, opts: PlanHybridOptions, written: bool) -> None:
    """A plan of one format per unit: the count per format, each unit's (or each kind's) choice, the error."""
    _print_head(rep, opts)
    print(
        f"  budget         {_signed_bytes(rep['budget_bytes_per_gpu'])} per GPU against the quantized checkpoint "
        f"(formats {', '.join(rep['formats'])}; nvfp4 block scales {rep['nvfp4_weight_scale']})"
    )
    count = ", ".join(f"{n} {f}" for f, n in rep["count"].items())
    print(f"  chosen         {count}: {_signed_bytes(rep['used_bytes_per_gpu'])} per GPU")
    by_kind: dict[str, dict[str, list[int]]] = {}
    for c in rep["chosen"]:
        by_kind.setdefault(c["id"].split(".")[-1], {}).setdefault(c["format"], []).append(int(c["id"].split(".")[1]))
    for kind, by_format in by_kind.items():
        parts = "; ".join(f"{f} layers {layer_ranges(layers)}" for f, layers in by_format.items())
        print(f"    {kind:<16} {parts}")
    pe = rep["predicted_error"]
    line = f"  predicted      error {pe['planned']:.3g}"
    if "quantized" in pe:
        line += f" (the quantized checkpoint: {pe['quantized']:.3g})"
    print(line)
    print(f"  headroom       {human_bytes(rep['headroom_bytes_per_gpu'])} per GPU left")
    for note in rep["notes"]:
        print(f"  note           {note}")
    if written:
        print(f"wrote {opts.out}; make it: qtool quantize {rep['bf16']} --recipe {opts.out} -o OUT")
        print(f"  then check it: {rep['verify']}")
    elif opts.dry_run:
        print("dry run: no recipe written")
