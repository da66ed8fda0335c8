"""qtool download REPO[@REVISION] -o DIR [--include GLOB ...] [--tensors PATTERN ...] [--link MODE] [--token T]
[--force] [--resume] [--dry-run] [--json] [--quiet]"""

from __future__ import annotations

from qtool.cli.common import add_output_flags, print_json, run_command_line, show_progress
from qtool.sizes import human_bytes


def add_arguments(p) -> None:
    p.add_argument("repo", metavar="REPO[@REVISION]", help="ORG/NAME or hf:ORG/NAME, optionally @branch/tag/commit")
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="only files matching GLOB (repeatable), e.g. '*.json' 'model-0000[1-3]-*'",
    )
    p.add_argument(
        "--tensors",
        action="append",
        default=[],
        metavar="PATTERN",
        help="fetch only the tensors matching PATTERN (glob, or re:REGEX; repeatable) by HTTP range "
        "requests and write a checkpoint of just those",
    )
    p.add_argument(
        "--link",
        choices=["auto", "reflink", "hardlink", "symlink", "copy"],
        default="auto",
        help="how whole files are placed in DIR from the HF cache (auto: reflink, else hardlink, else copy)",
    )
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login; never written anywhere)")
    add_output_flags(
        p,
        output="optional",
        output_help="output directory; without -o files only land in the HF cache and its snapshot path is printed",
    )


def run(args) -> int:
    from pathlib import Path

    from qtool.hub.resolve import parse_spec
    from qtool.ops import download as dl

    spec = parse_spec(args.repo, require_prefix=False)
    opts = dl.DownloadOptions(
        spec=spec,
        out=Path(args.output) if args.output else None,
        include=args.include,
        tensors=args.tensors,
        link=dl.LinkMode(args.link),
        token=args.token,
        force=args.force,
        resume=args.resume,
        command=run_command_line(),
    )
    plan = dl.plan(opts)
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, **plan.to_json()})
        else:
            _print_plan(plan.to_json())
        return 0
    report = dl.execute(plan, progress=show_progress(args)).to_json()
    if args.json:
        print_json(report)
        return 0
    _print_plan(plan.to_json())
    if report.get("mode") == "tensors":
        f = report["fetch"]
        print(
            f"fetched {human_bytes(f['bytes'])} in {f['requests']} range request(s)"
            + (f", {f['retries']} retried" if f["retries"] else "")
            + (
                f"; server ignored Range {f['ranges_ignored']}x ({human_bytes(f['bytes_discarded'])} discarded)"
                if f["ranges_ignored"]
                else ""
            )
        )
    else:
        print(f"downloaded {human_bytes(report['downloaded_bytes'])}; all files match the Hub's hashes")
        for msg in report["hash_failures_repaired"]:
            print(f"  re-downloaded after a hash mismatch: {msg}")
        if not args.output:
            print(f"snapshot: {report['snapshot']}")
    if args.output:
        print(f"written: {args.output} (commit {plan.listing.commit})")
    return 0


def _print_plan(j: dict) -> None:
    print(f"{j['repo']}@{j['revision'] or 'main'} -> commit {j['commit']}")
    if j["mode"] == "tensors":
        print(
            f"  {j['tensors']} tensor(s), {human_bytes(j['bytes'])} from {len(j['shards'])} shard(s), "
            f"{j['range_requests']} range request(s) after {j['header_requests']} header request(s)"
        )
        print(f"  + {len(j['side_files'])} non-weight file(s)")
    else:
        print(f"  {len(j['files'])} file(s), {human_bytes(j['bytes'])}")
