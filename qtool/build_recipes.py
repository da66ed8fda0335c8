"""Build recipes (`qtool build RECIPE.yaml`): sources, steps, output name. Validated at the boundary.

    name: qwen35-397b-hybrid              # the output directory name (default -o build/<name>)
    description: ...
    sources:
      nvfp4: {hub: nvidia/Qwen3.5-397B-A17B-NVFP4, revision: main}
      bf16:  {hub: Qwen/Qwen3.5-397B-A17B, revision: main, tensors: assemble}   # only what assemble needs
      local: {path: /models/x}
      tiny:  {builtin: tiny-bf16}          # embedded fixtures (qtool.fixtures.tiny), built into a cache
    steps:
      - id: hybrid
        op: assemble                      # download | quantize | convert | assemble | calibrate-kv |
        with: {nvfp4: nvfp4, bf16: bf16, bf16_expert_layers: [0], mtp: auto}   #  patch-config | verify
      - id: kv
        op: calibrate-kv
        input: hybrid                     # a source name or an earlier step id
        with: {samples: 4, seq_len: 512}
      - {id: patched, op: patch-config, input: kv, with: {fixes: [router-ignore, mtp-ignore]}}
      - {id: check, op: verify, input: patched, with: {engine: both, tp: 4}}

Inputs of a step are named in `input` (one) or, for assemble, in `with.nvfp4` / `with.bf16`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from qtool.build_with import INPUT_KEYS, REQUIRED_KEYS, Op, with_problems, with_schema
from qtool.errors import QtoolError
from qtool.hub.spec import parse_spec
from qtool.io.yamlio import load_recipe_yaml
from qtool.recipes import load_recipe, recipes_dir


class BuildRecipeError(QtoolError):
    """A build recipe that cannot be used (YAML, unknown keys, bad references)."""

    exit_code = 2


class SourceKind(str, Enum):
    HUB = "hub"
    PATH = "path"
    BUILTIN = "builtin"


BUILTINS = ("tiny-bf16", "tiny-bf16-fused", "tiny-nvfp4-modelopt", "tiny-nvfp4-modelopt-nomtp", "tiny-nvfp4-ct")

_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(frozen=True)
class Source:
    name: str
    kind: SourceKind
    ref: str  # repo id, path or builtin name
    revision: str | None = None
    tensors: str | None = None  # hub only: "assemble" -> fetch only what the consuming assemble step needs

    def to_json(self) -> dict:
        d = {"kind": self.kind.value, "ref": self.ref}
        if self.revision:
            d["revision"] = self.revision
        if self.tensors:
            d["tensors"] = self.tensors
        return d


@dataclass(frozen=True)
class Step:
    id: str
    op: Op
    inputs: tuple[str, ...]  # source names / step ids, in a fixed order
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"id": self.id, "op": self.op.value, "inputs": list(self.inputs), "with": self.params}


@dataclass
class BuildRecipe:
    name: str
    description: str
    sources: dict[str, Source]
    steps: list[Step]
    path: str | None = None

    def step(self, sid: str) -> Step:
        return next(s for s in self.steps if s.id == sid)

    @property
    def artifact_step(self) -> Step:
        """The last step that produces a checkpoint (verify only reports)."""
        for s in reversed(self.steps):
            if s.op is not Op.VERIFY:
                return s
        raise BuildRecipeError("the recipe has no step that produces an artifact", path=self.path)


def _err(msg: str, path: str | None, **kw) -> BuildRecipeError:
    return BuildRecipeError(msg, path=path, **kw)


def parse_build_recipe(data: object, *, path: str | None = None) -> BuildRecipe:
    if not isinstance(data, dict):
        raise _err("a build recipe is a YAML mapping", path)
    unknown = set(data) - {"name", "description", "sources", "steps"}
    if unknown:
        raise _err(
            f"unknown top-level key(s): {', '.join(sorted(map(str, unknown)))}",
            path,
            expected="name, description, sources, steps",
        )
    name = data.get("name")
    if not isinstance(name, str) or not _ID.fullmatch(name):
        raise _err("`name` must be a lower-case identifier (it names the output directory)", path, got=name)
    srcs = data.get("sources") or {}
    if not isinstance(srcs, dict) or not srcs:
        raise _err("`sources` must map names to {hub|path|builtin: ...}", path)
    sources: dict[str, Source] = {}
    for sname, s in srcs.items():
        sources[str(sname)] = _source(str(sname), s, path)
    raw_steps = data.get("steps") or []
    if not isinstance(raw_steps, list) or not raw_steps:
        raise _err("`steps` must be a non-empty list", path)
    steps: list[Step] = []
    known = set(sources)
    for i, st in enumerate(raw_steps):
        steps.append(_step(i, st, known, path))
        if steps[-1].id in known:
            raise _err(f"step id {steps[-1].id!r} is already used by a source or step", path)
        known.add(steps[-1].id)
    for s in sources.values():
        if s.tensors == "assemble" and not any(
            st.op is Op.ASSEMBLE and st.params.get("bf16") == s.name for st in steps
        ):
            raise _err(f"source {s.name!r} has `tensors: assemble` but no assemble step takes it as bf16", path)
    rec = BuildRecipe(name, str(data.get("description") or ""), sources, steps, path)
    rec.artifact_step  # noqa: B018 - validates
    return rec


def _source(name: str, s: object, path: str | None) -> Source:
    if not isinstance(s, dict):
        raise _err(f"source {name!r} must be a mapping", path)
    kinds = [k for k in ("hub", "path", "builtin") if k in s]
    if len(kinds) != 1:
        raise _err(f"source {name!r} needs exactly one of hub / path / builtin", path, got=sorted(s))
    kind = SourceKind(kinds[0])
    unknown = set(s) - {kinds[0], "revision", "tensors"}
    if unknown:
        raise _err(f"source {name!r}: unknown key(s) {', '.join(sorted(map(str, unknown)))}", path)
    ref = s[kinds[0]]
    if not isinstance(ref, str) or not ref:
        raise _err(f"source {name!r}: `{kinds[0]}` must be a non-empty string", path, got=repr(ref))
    if kind is SourceKind.BUILTIN and ref not in BUILTINS:
        raise _err(f"source {name!r}: unknown builtin", path, got=ref, expected=", ".join(BUILTINS))
    if kind is not SourceKind.HUB and ("revision" in s or "tensors" in s):
        raise _err(f"source {name!r}: revision/tensors only apply to hub sources", path)
    if kind is SourceKind.HUB:
        parse_spec(ref, require_prefix=False)
    tensors = s.get("tensors")
    if tensors not in (None, "assemble"):
        raise _err(f"source {name!r}: tensors must be 'assemble'", path, got=tensors)
    rev = s.get("revision")
    if rev is not None and not isinstance(rev, str):
        raise _err(
            f"source {name!r}: `revision` must be a string (a branch, tag or commit)",
            path,
            got=repr(rev),
            hint='quote it: revision: "0123abc" (YAML reads bare digits as a number)',
        )
    return Source(name, kind, ref, rev, tensors)


def _step(i: int, st: object, known: set[str], path: str | None) -> Step:
    if not isinstance(st, dict):
        raise _err(f"step {i} must be a mapping", path)
    unknown = set(st) - {"id", "op", "input", "with"}
    if unknown:
        raise _err(
            f"step {i}: unknown key(s) {', '.join(sorted(map(str, unknown)))}", path, expected="id, op, input, with"
        )
    sid = st.get("id")
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        raise _err(f"step {i}: `id` must be a lower-case identifier", path, got=sid)
    try:
        op = Op(st.get("op"))
    except (ValueError, TypeError):
        raise _err(
            f"step {sid!r}: unknown op", path, got=st.get("op"), expected=", ".join(o.value for o in Op)
        ) from None
    params = {} if st.get("with") is None else st["with"]  # `with:` left empty: no options
    if not isinstance(params, dict):
        raise _err(f"step {sid!r}: `with` must be a mapping", path)
    _check_with(sid, op, params, path)
    input_keys = INPUT_KEYS.get(op, ())
    if input_keys:
        if "input" in st:
            raise _err(f"step {sid!r}: {op.value} names its inputs in `with` ({', '.join(input_keys)})", path)
        missing = [k for k in input_keys if k not in params]
        if missing:
            raise _err(f"step {sid!r}: missing input(s) {', '.join(missing)}", path)
        inputs = tuple(params[k] for k in input_keys)
    else:
        if "input" not in st:
            raise _err(f"step {sid!r}: `input` (a source or an earlier step) is required", path)
        if not isinstance(st["input"], str):
            raise _err(f"step {sid!r}: `input` must name a source or an earlier step", path, got=st["input"])
        inputs = (st["input"],)
    for ref in inputs:
        if ref not in known:
            raise _err(
                f"step {sid!r}: input {ref!r} is neither a source nor an earlier step",
                path,
                expected=", ".join(sorted(known)),
            )
    return Step(sid, op, inputs, dict(params))


def _check_with(sid: str, op: Op, params: dict, path: str | None) -> None:
    """Every `with` key known to `op` and of the type and values it takes (qtool.build_with)."""
    schema = with_schema(op)
    bad = set(params) - set(schema)
    if bad:
        raise _err(
            f"step {sid!r} ({op.value}): unknown option(s) {', '.join(sorted(map(str, bad)))}",
            path,
            expected=", ".join(sorted(schema)),
        )
    missing = [k for k in REQUIRED_KEYS.get(op, ()) if k not in params]
    if missing:
        raise _err(
            f"step {sid!r} ({op.value}): `with` needs {', '.join(missing)}",
            path,
            hint=f"add {missing[0]}: to the step's `with`",
        )
    for key, expected, got in with_problems(op, params):
        raise _err(
            f"step {sid!r} ({op.value}): `with.{key}` must be {expected}",
            path,
            expected=expected,
            got=repr(got),
            hint=f"correct `{key}:` in step {sid!r}" + (" (leave the key out for its default)" if got is None else ""),
        )


def shipped_build_recipes() -> dict[str, Path]:
    """name -> file of every build recipe shipped with qtool (package data)."""
    return {p.stem: p for p in sorted((recipes_dir() / "build").glob("*.yaml"))}


def find_build_recipe(name_or_path: str | Path) -> Path:
    """A build recipe file: a path, or the name of a shipped one (`demo-tiny`)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or len(p.parts) > 1 or (os.path.lexists(p) and not p.is_dir()):
        return p
    shipped = shipped_build_recipes()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    raise BuildRecipeError(
        "no such build recipe",
        got=str(name_or_path),
        expected=sorted(shipped),
        hint="pass a shipped build recipe's name (qtool recipes list) or a YAML file's path",
    )


def _resolve_file_refs(recipe: BuildRecipe, base: Path) -> None:
    """A quantize step's `recipe:` file resolves relative to the build recipe's own folder, then as a
    shipped recipe of that name, so a build recipe runs from any working directory."""
    for st in recipe.steps:
        ref = st.params.get("recipe")
        if st.op is not Op.QUANTIZE or not isinstance(ref, str) or not Path(ref).suffix or Path(ref).is_absolute():
            continue
        beside = base / ref
        if beside.is_file():
            st.params["recipe"] = str(beside.resolve())
        elif (recipes_dir() / Path(ref).name).is_file():
            st.params["recipe"] = Path(ref).stem  # the shipped recipe of that name
        # else: left as written, resolved against the working directory (and refused there if missing)


def _check_quantize_recipes(recipe: BuildRecipe) -> None:
    """Each quantize step's quantization recipe loads (a RecipeError names that file), before any step runs."""
    for st in recipe.steps:
        if st.op is Op.QUANTIZE and "recipe" in st.params:
            load_recipe(st.params["recipe"])


def load_build_recipe(name_or_path: str | Path) -> BuildRecipe:
    """A build recipe by shipped name or path, strictly read (qtool.io.yamlio) and validated, each step's
    `with` included; BuildRecipeError (a usage error) names the file and the key."""
    p = find_build_recipe(name_or_path)
    recipe = parse_build_recipe(load_recipe_yaml(p, "build recipe", BuildRecipeError), path=str(p))
    _resolve_file_refs(recipe, p.resolve().parent)
    _check_quantize_recipes(recipe)
    return recipe
