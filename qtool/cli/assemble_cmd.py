"""qtool assemble hybrid --nvfp4 SRC --bf16 SRC -o OUT [--bf16-expert-layers LIST]
[--bf16-shared-experts all|none|LIST] [--mtp MODE]
[--link MODE] [--max-shard-size SIZE] [--resume] [--force] [--dry-run] [--json] [--quiet]"""

from __future__ import annotations

import re
from pathlib import Path

from qtool.cli.common import add_output_flags, human_bytes, print_json, run_command_line, show_progress
from qtool.cli.sources import headers_checkpoint, local_checkpoint
from qtool.errors import UsageError
from qtool.hub.resolve import fetch_tensor_patterns
from qtool.hub.spec import is_hub_spec
from qtool.io.writer import parse_size
from qtool.ops.assemble import HybridOptions, LinkMode, MtpMode, execute, plan_hybrid
from qtool.ops.assemble.model import bf16_source_patterns


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="kind", metavar="KIND")
    h = sub.add_parser(
        "hybrid",
        help="BF16 shared experts (and chosen layers' routed experts, MTP head) spliced into an NVFP4 checkpoint",
    )
    h.add_argument("--nvfp4", required=True, help="NVFP4 checkpoint (ModelOpt or compressed-tensors naming)")
    h.add_argument("--bf16", required=True, help="the BF16 original (fused or per-expert routed experts)")
    h.add_argument(
        "--bf16-expert-layers",
        default=None,
        metavar="LIST",
        help="comma-separated decoder layers whose routed experts come from BF16, e.g. 0 or 0,1 (default none)",
    )
    h.add_argument(
        "--bf16-shared-experts",
        default="all",
        metavar="all|none|LIST",
        help="whose shared experts come from BF16: all layers (default), none, or e.g. 0,1,5",
    )
    h.add_argument(
        "--mtp",
        choices=["auto", "from-bf16", "keep", "drop"],
        default="auto",
        help="MTP head: auto grafts BF16's when the NVFP4 source has none (default)",
    )
    h.add_argument(
        "--link",
        choices=["auto", "reflink", "hardlink", "copy"],
        default="auto",
        help="how unchanged shards are placed (auto: reflink, else hardlink, else copy)",
    )
    h.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="e.g. 5GB (default: 5%% above the NVFP4 source's largest shard, at least 5GB)",
    )
    add_output_flags(h)


# a layer list: ASCII layer numbers separated by commas (spaces only around a comma): "0 1" is not layer 1,
# "1_0" is not layer 10 and "٣" is not layer 3, as Python's int() would read them
LAYER_LIST = re.compile(r"[0-9]+(\s*,\s*[0-9]+)*")


def _layers(text: str | None, flag: str = "--bf16-expert-layers") -> tuple[int, ...]:
    """A layer list flag: `none` (or the flag left out) -> (), else its layers, sorted."""
    if text is None or text.strip().lower() == "none":
        return ()
    if not LAYER_LIST.fullmatch(text.strip()):
        raise UsageError(
            f"{flag} takes layer numbers separated by commas (e.g. 0,3,5), or none",
            got=repr(text),
            hint=f"{flag} 0,1 for layers 0 and 1",
        )
    return tuple(sorted({int(x) for x in text.split(",")}))


def _shared_layers(text: str) -> tuple[int, ...] | None:
    """--bf16-shared-experts: all -> None (every layer), none -> (), else the layers."""
    return None if text.strip().lower() == "all" else _layers(text, "--bf16-shared-experts")


def run(args) -> int:
    if getattr(args, "kind", None) != "hybrid":
        raise UsageError("assemble needs a kind", expected="qtool assemble hybrid ...")

    try:
        max_size = parse_size(args.max_shard_size) if args.max_shard_size else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    layers = _layers(args.bf16_expert_layers)
    shared = _shared_layers(args.bf16_shared_experts)
    # --dry-run reads headers only, also of hf: sources (qtool.hub.headers); a real run fetches what it copies
    src = headers_checkpoint if args.dry_run else local_checkpoint
    opts = HybridOptions(
        nvfp4=src(args.nvfp4),
        bf16=(
            headers_checkpoint(args.bf16)
            if args.dry_run
            else _bf16_source(args.bf16, layers, args.mtp, show_progress(args), shared)
        ),
        out=Path(args.output),
        bf16_expert_layers=layers,
        bf16_shared_expert_layers=shared,
        mtp=MtpMode(args.mtp),
        link=LinkMode(args.link),
        max_shard_size=max_size,
        force=args.force,
        resume=args.resume,
        command=run_command_line(),
    )
    plan = plan_hybrid(opts)
    summary = plan.summary()
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, "plan": summary})
        else:
            _print_plan(summary)
        return 0
    result = execute(plan, progress=show_progress(args))
    if args.json:
        print_json({"plan": summary, "result": result.to_json()})
        return 0
    _print_plan(summary, header=f"assembled {result.out}")
    linked = ", ".join(f"{n} {m}" for m, n in sorted(result.shards_linked.items())) or "none"
    print(
        f"  written        {result.shards_written} shard(s); placed unchanged: {linked}; "
        f"resumed: {result.shards_resumed}"
    )
    checks = result.checks
    print(
        f"  checks         {'passed' if checks['passed'] else 'FAILED'} "
        f"({', '.join(c['name'] for c in checks['checks'])})"
    )
    return 0


def _print_plan(s: dict, header: str | None = None) -> None:
    b = s["bytes"]
    print(header or f"plan: {s['out']} (dry run, nothing written)")
    print(f"  sources        NVFP4 {s['nvfp4']} ({s['flavour']}), BF16 {s['bf16']}")
    t = s["tensors"]
    shared = s.get("bf16_shared_expert_layers")
    shared = (
        "shared experts of every layer"
        if shared is None
        else f"shared experts of layers {shared}"
        if shared
        else "no shared expert"
    )
    print(
        f"  from BF16      {t['from_bf16']} tensors ({t['unfused']} unfused from the fused layout): {shared}"
        + (f", routed experts of layers {s['bf16_expert_layers']}" if s["bf16_expert_layers"] else "")
    )
    print(f"  MTP            {s['mtp']}")
    bf16 = t["removed"] - t["removed_quantized"]
    print(
        f"  replaced       {t['removed']} tensors of the NVFP4 input ({t['removed_quantized']} quantized, "
        f"{bf16} BF16 already)"
    )
    sh = s["shards"]
    print(f"  shards         {sh['link']} unchanged (linked), {sh['rebuild']} rebuilt, {sh['new']} new")
    print(
        f"  bytes          reused {human_bytes(b['reused'])}, rewritten {human_bytes(b['rewritten'])}, "
        f"new {human_bytes(b['new'])}; output {human_bytes(b['output'])}"
    )
    print(f"  ignore added   {s['ignore_added']}")
    for w in s["warnings"]:
        print(f"  warning        {w}")


def _bf16_source(spec: str, layers: tuple[int, ...], mtp: str, progress: bool, shared=None) -> Path:
    """A Hub BF16 source is range-fetched: only the tensors the plan can take (shared experts, chosen
    layers' experts, MTP head: ~1.5 GB of the 397B's ~800 GB); local paths are used as they are."""
    if not is_hub_spec(spec):
        return Path(spec)
    return fetch_tensor_patterns(spec, bf16_source_patterns(layers, mtp, shared), progress=progress)
