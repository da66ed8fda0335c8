"""qtool recipes list | show NAME: the recipes shipped with qtool (package data) and what each will do."""

from __future__ import annotations

import os

from qtool.build_recipes import find_build_recipe, load_build_recipe, shipped_build_recipes
from qtool.cli.common import add_json_flag, print_json
from qtool.errors import UsageError
from qtool.io.yamlio import load_recipe_yaml
from qtool.recipes import list_recipes, load_recipe, recipes_dir


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    add_json_flag(sub.add_parser("list", help="the shipped quantization and build recipes"))
    show = sub.add_parser("show", help="one recipe: its file and what it will do")
    show.add_argument("name", help="a shipped recipe's name (quantization or build) or a YAML file's path")
    add_json_flag(show)


def _listing() -> dict:
    return {
        "quantize": {n: load_recipe(n).description for n in list_recipes()},
        "build": {n: load_build_recipe(p).description for n, p in shipped_build_recipes().items()},
    }


def _show(name: str) -> dict:
    """A quantization recipe (what each module group becomes) or a build recipe (its sources and steps)."""
    from pathlib import Path

    given = os.path.lexists(name) and not os.path.isdir(name) and name not in list_recipes()
    data = load_recipe_yaml(name, "recipe", UsageError) if given else None  # a FIFO is refused here
    if name in list_recipes() or (given and not (isinstance(data, dict) and "steps" in data)):
        r = load_recipe(name)
        return {
            "kind": "quantize",
            "file": r.path,
            **r.to_json(),
            "does": [f"{g}: {s.value}" for g, s in sorted(r.groups.items())]
            + [f"layer {n}: {g} {s.value}" for n, o in sorted(r.layer_overrides.items()) for g, s in sorted(o.items())]
            + ["every other group: bf16 (kept)", f"kv cache: {r.kv_cache.value}"]
            + (
                [
                    (
                        f"calibrates on {r.calibration['dataset']}: {r.calibration['samples']} x "
                        f"{r.calibration['seq_len']} tokens"
                    )
                ]
                if r.calibration
                else []
            ),
            "text": Path(r.path).read_text(),
        }
    if name in shipped_build_recipes() or given:
        path = find_build_recipe(name)
        b = load_build_recipe(path)
        return {
            "kind": "build",
            "file": str(path),
            "name": b.name,
            "description": b.description,
            "sources": {n: s.to_json() for n, s in b.sources.items()},
            "does": [f"{st.id}: {st.op.value} {', '.join(st.inputs)} with {st.params}" for st in b.steps],
            "text": Path(path).read_text(),
        }
    raise UsageError(
        "no such recipe",
        got=name,
        expected=list_recipes() + sorted(shipped_build_recipes()),
        hint=f"qtool recipes list (shipped in {recipes_dir()})",
    )


def run(args) -> int:
    if args.action == "list":
        rep = _listing()
        if args.json:
            print_json(rep)
            return 0
        for kind, names in rep.items():
            print(f"{kind} recipes:")
            for n, desc in names.items():
                print(f"  {n:34s} {desc}")
        return 0
    rep = _show(args.name)
    if args.json:
        print_json(rep)
        return 0
    print(f"{rep['kind']} recipe {rep.get('name')}  ({rep['file']})")
    print(f"  {rep.get('description') or ''}")
    for line in rep["does"]:
        print(f"  - {line}")
    print()
    print(rep["text"], end="")
    return 0
