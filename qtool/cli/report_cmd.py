"""qtool report CKPT [CKPT2] [--ref REF | --kld KLD.json ...] [--engine ...] [--tp 4 --gpus 4x96GB]
-o report.html [--force] [--dry-run] [--json]"""

from __future__ import annotations

from pathlib import Path

from qtool.cli.common import add_output_flags, check_device, print_json
from qtool.cli.eval_cmd import add_window_flags
from qtool.cli.sources import headers_checkpoint, local_checkpoint
from qtool.cli.verify_cmd import add_common
from qtool.cli.verify_cmd import options as verify_options
from qtool.errors import UsageError
from qtool.ops import report
from qtool.ops.kld import KldOptions
from qtool.ops.report.data import Artifact


def add_arguments(p) -> None:
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CKPT",
        help="checkpoint directory or hf:ORG/NAME[@REV] (header-only); two compare side by side",
    )
    p.add_argument(
        "--engine",
        default="both",
        help="engines whose behaviour is drawn: vllm, sglang, both (default), or versions like vllm@0.33.0",
    )
    add_common(p)
    p.add_argument(
        "--ref",
        metavar="REF",
        help="run eval kld of each CKPT against REF (a checkpoint, dump or compact reference) and draw the KLD",
    )
    p.add_argument(
        "--kld",
        metavar="KLD.json",
        action="append",
        default=[],
        help="a saved `qtool eval kld --json` result, one per CKPT in order (instead of --ref)",
    )
    p.add_argument(
        "--sensitivity",
        metavar="S",
        default=None,
        help="a `qtool sensitivity` output: drawn as a heat layer on the format grid",
    )
    add_window_flags(p)
    add_output_flags(p, resume=False, output_help="the HTML file to write (atomically)")


def run(args) -> int:
    check_device(args.device)
    if not args.ref and any(a != b for a, b in ((args.dataset, "builtin"), (args.windows, 4), (args.seq_len, 512))):
        raise UsageError("--dataset, --windows and --seq-len choose eval kld's windows: they need --ref")
    # header-only for what reads headers; --ref runs the models, so their data is downloaded (verified)
    fetch = local_checkpoint if args.ref else headers_checkpoint
    artifacts = tuple(Artifact(Path(fetch(spec)), str(spec)) for spec in args.checkpoints)
    ref = local_checkpoint(args.ref, progress=False) if args.ref and not args.dry_run else args.ref
    opts = report.ReportOptions(
        artifacts=artifacts,
        out=Path(args.output),
        verify=verify_options(args, args.engine),
        ref=None if ref is None else str(ref),
        ref_label=args.ref,
        kld=tuple(args.kld),
        kld_options=KldOptions(dataset=args.dataset, windows=args.windows, seq_len=args.seq_len, device=args.device),
        force=args.force,
        kv_cache_dtype=args.kv_cache_dtype,
        sensitivity=Path(args.sensitivity) if args.sensitivity else None,
    )
    p = report.plan(opts)
    if args.dry_run:
        if args.json:
            print_json({"plan": p.to_json()})
        else:
            print(
                f"plan: report on {', '.join(a.label for a in artifacts)} -> {opts.out}"
                + (f"; eval kld against {args.ref}" if ref else "")
                + (f"; KLD from {', '.join(args.kld)}" if args.kld else "")
            )
        return 0
    res = report.execute(p)
    if args.json:
        print_json(res.to_json())
        return 0
    verdicts = ", ".join(
        f"{label}: {'ok' if ok else 'FAILED verify'}" for label, ok in zip(res.artifacts, res.ok, strict=True)
    )
    print(f"wrote {res.path} ({res.bytes / 1024:.0f} KiB; {verdicts})")
    return 0
