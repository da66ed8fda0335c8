"""qtool patch-config CKPT [--fix NAME ...] [--ignore-add P] [--ignore-remove P] [--yarn F] ... [-o OUT]"""

from __future__ import annotations

from qtool.cli.common import add_output_flags, print_json, run_command_line
from qtool.cli.sources import headers_checkpoint, local_only
from qtool.errors import UsageError
from qtool.ops import patch_config as pc

FIX_NAMES = [
    "router-ignore",
    "mtp-ignore",
    "ignore-from-tensors",
    "kv-scheme-from-tensors",
]  # qtool.ops.patch_config.Fix


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (its config files are patched in place, atomically)")
    p.add_argument("--fix", action="append", default=[], choices=FIX_NAMES, help="a named fix (repeatable)")
    p.add_argument("--ignore-add", action="append", default=[], metavar="PATTERN")
    p.add_argument("--ignore-remove", action="append", default=[], metavar="PATTERN")
    p.add_argument("--yarn", type=float, metavar="FACTOR", help="YaRN rope scaling factor (e.g. 4)")
    p.add_argument("--original-max-position", type=int, metavar="N")
    p.add_argument("--sampling-defaults", action="store_true", help="recommended sampling into generation_config.json")
    add_output_flags(
        p,
        output="optional",
        output_help="write a patched copy to OUT (unchanged files linked) instead of patching in place",
    )


def run(args) -> int:
    if not (args.fix or args.ignore_add or args.ignore_remove or args.yarn or args.sampling_defaults):
        raise UsageError("no fix given", hint="e.g. --fix router-ignore --fix mtp-ignore (see --help)")
    plan = pc.plan(
        pc.PatchOptions(
            headers_checkpoint(args.checkpoint) if args.dry_run else local_only(args.checkpoint),
            fixes=tuple(args.fix),
            ignore_add=tuple(args.ignore_add),
            ignore_remove=tuple(args.ignore_remove),
            yarn=args.yarn,
            original_max_position=args.original_max_position,
            sampling_defaults=args.sampling_defaults,
            out=args.output,
            force=args.force,
            resume=args.resume,
            command=run_command_line(),
        )
    )
    written = [] if args.dry_run else pc.execute(plan).to_json()["written"]
    if args.json:
        out = plan.to_json()
        out["dry_run"] = args.dry_run
        out["written"] = written
        print_json(out)
        return 0
    for r in plan.results:
        print(f"{'applied' if r.applied else 'no change':>9}  {r.fix}: {r.message}")
    for f in plan.files.values():
        if f.changed:
            d = f.diff()
            print(d, end="" if d.endswith("\n") else "\n")  # a file without a final newline: the diff has none
    if args.dry_run:
        print("dry run: nothing written")
    elif written:
        print(f"written: {', '.join(written)}")
    return 0
