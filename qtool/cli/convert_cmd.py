"""qtool convert SRC -o OUT --to modelopt|compressed-tensors [--force] [--resume] [--dry-run] [--json] [--quiet]"""

from __future__ import annotations

from qtool.cli.common import add_output_flags, print_json, run_command_line
from qtool.cli.sources import local_checkpoint
from qtool.ops import convert


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="NVFP4 checkpoint (ModelOpt or compressed-tensors)")
    p.add_argument("--to", required=True, choices=["modelopt", "compressed-tensors"], help="target flavour")
    add_output_flags(p)


def run(args) -> int:
    opts = convert.ConvertOptions(
        local_checkpoint(args.checkpoint),
        out=args.output,
        to=convert.Flavour(args.to),
        force=args.force,
        resume=args.resume,
        command=run_command_line(),
    )
    p = convert.plan(opts)
    rep = convert.describe(p) if args.dry_run else convert.execute(p).to_json()
    if args.json:
        print_json(rep)
        return 0
    print(f"{rep['checkpoint']} ({rep['from']}) -> {rep['output']} ({rep['to']})")
    print(
        f"  {rep['renamed_tensors']} tensors renamed; rewrites {len(rep['rewritten_shards'])} shard(s), "
        f"reuses {len(rep['linked_shards'])}"
    )
    for pr in rep.get("problems", []):
        print(f"  problem      {pr['code']}: {pr['message']}")
    for w in rep.get("warnings", []):
        print(f"  warning      {w['code']}: {w['message']}")
    return 0
