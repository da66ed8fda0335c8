"""qtool build RECIPE.yaml [-o DIR] [--source NAME=PATH ...] [--token T] [--force] [--resume] [--dry-run]
[--json] [--quiet]"""

from __future__ import annotations

from qtool.cli.common import add_output_flags, print_json, run_command_line, show_progress
from qtool.sizes import human_bytes


def add_arguments(p) -> None:
    p.add_argument("recipe", help="build recipe (YAML), e.g. recipes/build/demo-tiny.yaml")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="use a local directory for a recipe source (repeatable; also $QTOOL_BUILD_SOURCES)",
    )
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login; never written anywhere)")
    add_output_flags(
        p,
        output="optional",
        output_help="final artifact directory (default: build/<recipe name>); step outputs live in DIR.build/",
    )


def run(args) -> int:
    from pathlib import Path

    from qtool.build_recipes import load_build_recipe
    from qtool.fixtures.builtin import builtin_source
    from qtool.ops import pipeline as build
    from qtool.ops.pipeline.plan import parse_overrides
    from qtool.ops.pipeline.steps import validate_steps

    recipe = load_build_recipe(args.recipe)
    bp = build.plan(
        recipe,
        out=Path(args.output) if args.output else None,
        overrides=parse_overrides(args.source),
        token=args.token,
        builtins=builtin_source,
    )
    if args.dry_run:
        validate_steps(bp)
        if args.json:
            print_json({"dry_run": True, **bp.to_json()})
        else:
            _print_plan(bp)
        return 0
    report = build.run(
        bp,
        resume=args.resume,
        progress=show_progress(args),
        token=args.token,
        command=run_command_line(),
        force=args.force,
    )
    if args.json:
        print_json({**bp.to_json(), **report})
        return 0
    _print_plan(bp, ran=set(report["ran"]))
    print(f"ran: {', '.join(report['ran']) or '-'}; skipped (unchanged): {', '.join(report['skipped']) or '-'}")
    print(f"{'published' if report['published'] else 'up to date'}: {report['out']}")
    copied = report["shards_placed"].get("copy")
    if copied:
        print(
            f"  shards copied ({human_bytes(copied)} more on disk): this filesystem has no reflinks, and the "
            "published artifact never shares a file with the step cache in "
            f"{report['out']}.build/ (delete that folder once you no longer need its steps)"
        )
    return 0


def _print_plan(bp, ran: set[str] | None = None) -> None:
    """The plan; after a run (`ran` given) each step says whether it ran now or was reused."""
    print(f"recipe {bp.recipe.name} -> {bp.out}")
    for n, s in bp.sources.items():
        ident = s.identity
        where = ident.get("commit") or ident.get("path") or ident.get("name")
        print(
            f"  source {n:<10} {s.source.kind.value:<8} {s.source.ref} -> {where}"
            + (" (override)" if s.overridden else "")
        )
    for sp in bp.steps:
        v = sp.validation or {}
        extra = f" [{v.get('status')}]" if v else ""
        state = sp.state if ran is None else ("ran" if sp.step.id in ran else "reused (unchanged)")
        print(f"  step   {sp.step.id:<10} {sp.step.op.value:<13} {sp.key[:12]} {state}{extra}")
    for warning in bp.warnings:
        print(f"  note: {warning}")
