"""Resolve sources to identities and compute every step's content key (no tensor data is read, nothing is
written; a local source's files are hashed when the build runs, see hash_sources)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qtool.build_recipes import BuildRecipe, Op, Source, SourceKind, Step
from qtool.errors import CheckpointError, PlanError, UsageError
from qtool.io.output import STEP_MARKER

OVERRIDE_ENV = "QTOOL_BUILD_SOURCES"  # "name=path,name=path": replace recipe sources by local dirs


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def sha(obj) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


@dataclass
class ResolvedSource:
    source: Source
    identity: dict
    key: str
    path: Path | None  # local directory, when known without downloading
    overridden: bool = False
    # a local source's digests re-recorded in the sha256 cache once the build ran (dir_fingerprint)
    refresh: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def unhashed(self) -> bool:
        """A local source some of whose files have no sha256 on record yet (see dir_fingerprint)."""
        return self.identity.get("kind") == "path" and self.identity.get("digest") is None

    def to_json(self) -> dict:
        return {
            **self.source.to_json(),
            "identity": self.identity,
            "key": self.key,
            "path": str(self.path) if self.path else None,
            "overridden": self.overridden,
        }


@dataclass
class StepPlan:
    step: Step
    key: str
    dir: Path
    cached: bool
    input_keys: list[str]
    validation: dict | None = None  # what the op's own plan() said (dry run)

    @property
    def state(self) -> str:
        return "cached" if self.cached else "run"

    def to_json(self) -> dict:
        return {
            **self.step.to_json(),
            "key": self.key,
            "dir": str(self.dir),
            "state": self.state,
            "input_keys": self.input_keys,
            "validation": self.validation,
        }


@dataclass
class BuildPlan:
    recipe: BuildRecipe
    out: Path
    work: Path
    sources: dict[str, ResolvedSource]
    steps: list[StepPlan]
    warnings: list[str] = field(default_factory=list)

    @property
    def final_key(self) -> str:
        return next(s.key for s in self.steps if s.step.id == self.recipe.artifact_step.id)

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "recipe_path": self.recipe.path,
            "out": str(self.out),
            "work": str(self.work),
            "sources": {n: s.to_json() for n, s in self.sources.items()},
            "steps": [s.to_json() for s in self.steps],
            "final_key": self.final_key,
            "warnings": self.warnings,
        }


def parse_overrides(items: list[str] | None, env: str | None = None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    raw = [x for x in (env or os.environ.get(OVERRIDE_ENV, "")).split(",") if x.strip()] + list(items or [])
    for item in raw:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UsageError("a source override is NAME=PATH", got=item, hint="e.g. --source bf16=/models/bf16")
        out[name.strip()] = Path(path.strip())
    return out


def dir_fingerprint(root: Path, *, read: bool = True) -> tuple[dict, Callable[[], None]]:
    """Identity of a local directory by content: every file's relative name, size and sha256, found as an
    op's input digests are (qtool.io.manifest.InputHasher: a Hub cache blob's name, huggingface_hub's
    download record, or the sha256 cache, trusted only while a file's ctime is unchanged); a first build
    reads the files once, later ones stat them. Size and mtime alone missed a same-size edit with the mtime
    put back, which the step cache (hard links of the source) then served as the old content. Returns the
    identity and the refresh to call once the build has made and removed its links to the files.

    read=False (planning: headers and configs only): no file is read; where a digest is not on record the
    identity's `digest` is None and `unhashed` / `unhashed_bytes` say what the build will read to hash."""
    from qtool.io.manifest import InputHasher

    files = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    hasher = InputHasher()  # its pool starts threads only for files it is given to read
    try:
        if read:
            for p in files:
                hasher.submit(str(p))
            digests = hasher.results()
        else:
            digests = {str(p): hasher.known(str(p)) for p in files}
    finally:
        hasher.close()
    unhashed = [p for p in files if digests[str(p)] is None]
    if unhashed:
        return {
            "files": len(files),
            "digest": None,
            "unhashed": len(unhashed),
            "unhashed_bytes": sum(p.stat().st_size for p in unhashed),
        }, lambda: None
    entries = [[str(p.relative_to(root)), p.stat().st_size, digests[str(p)]] for p in files]
    return {"files": len(files), "digest": sha(entries)}, lambda: hasher.refresh(digests)


def _path_source(src: Source, path: Path, *, overridden: bool, read: bool) -> ResolvedSource:
    fingerprint, refresh = dir_fingerprint(path, read=read)
    ident = {"kind": "path", "path": str(path.resolve()), **fingerprint}
    if overridden:
        ident["stands_for"] = src.to_json()
    return ResolvedSource(src, ident, sha(ident), path, overridden=overridden, refresh=refresh)


def hash_sources(bp: BuildPlan) -> None:
    """The first thing a build executes: hash the local sources whose digests were not on record when it
    planned (planning reads no data), and key the steps again by that content."""
    unhashed = [n for n, s in bp.sources.items() if s.unhashed]
    for name in unhashed:
        old = bp.sources[name]
        bp.sources[name] = _path_source(old.source, old.path, overridden=old.overridden, read=True)
        bp.warnings.remove(_unhashed_warning(name, old))
    if unhashed:
        _key_steps(bp.steps, bp.work, {n: s.key for n, s in bp.sources.items()})


def _unhashed_warning(name: str, rs: ResolvedSource) -> str:
    return (
        f"source {name}: {rs.identity['unhashed']} file(s), {rs.identity['unhashed_bytes'] / 1e9:.1f} GB, "
        "not hashed yet: the build reads them once before its first step (their content names the "
        "steps); a step that depends on them shows as 'run' until then"
    )


# (directory, identity) of a `builtin:` source; qtool.fixtures.builtin.builtin_source is the one qtool has
BuiltinSources = Callable[[str], tuple[Path, dict]]


def _hub_commit(spec, token: str | None) -> str:
    """The source's commit: asked of the Hub, or, offline (HF_HUB_OFFLINE=1) or with the Hub unreachable,
    what is cached (a pinned commit, a branch resolved before)."""
    from qtool.hub.download import repo_listing
    from qtool.hub.resolve import HubError, cached_commit, hub_offline

    if hub_offline():
        commit = cached_commit(spec)
        if commit is None:
            raise HubError(
                "HF_HUB_OFFLINE is set and this source's revision was never resolved here",
                path=str(spec),
                hint="pin it (revision: COMMIT) or run once online",
            )
        return commit
    try:
        return repo_listing(spec, token=token).commit
    except HubError as e:
        if "network error" in e.message and cached_commit(spec):
            return cached_commit(spec)
        raise


def resolve_source(
    src: Source, override: Path | None, *, token: str | None = None, builtins: BuiltinSources | None = None
) -> ResolvedSource:
    if override is not None:
        if not override.exists():
            raise CheckpointError(f"override for source {src.name!r} does not exist", path=override)
        return _path_source(src, override, overridden=True, read=False)
    if src.kind is SourceKind.PATH:
        p = Path(src.ref).expanduser()
        if not p.exists():
            raise CheckpointError(
                f"source {src.name!r}: path does not exist",
                path=p.absolute(),
                hint=f"a relative path in a recipe is read from the working directory ({Path.cwd()}): write the "
                f"absolute path in the recipe, or give it: --source {src.name}=PATH",
            )
        return _path_source(src, p, overridden=False, read=False)
    if src.kind is SourceKind.BUILTIN:
        if builtins is None:
            raise PlanError(
                f"source {src.name!r} is builtin:{src.ref}, and no builtin sources were given",
                hint="pass builtins=qtool.fixtures.builtin.builtin_source (qtool build does)",
            )
        path, version = builtins(src.ref)
        ident = {"kind": "builtin", "name": src.ref, **version}
        return ResolvedSource(src, ident, sha(ident), path)
    from qtool.hub.resolve import parse_spec

    spec = parse_spec(src.ref + (f"@{src.revision}" if src.revision else ""), require_prefix=False)
    ident = {
        "kind": "hub",
        "repo": spec.repo_id,
        "revision": spec.revision,
        "commit": _hub_commit(spec, token),
        "tensors": src.tensors,
    }
    return ResolvedSource(src, ident, sha(ident), None)


def plan(
    recipe: BuildRecipe,
    *,
    out: Path | None = None,
    overrides: dict[str, Path] | None = None,
    token: str | None = None,
    builtins: BuiltinSources | None = None,
) -> BuildPlan:
    """Headers and configs only: a local source whose digests are not on record yet is hashed by `run`
    (hash_sources), and until then the steps after it are keyed by a placeholder and show as `run`. Each
    step's own op plan is checked by qtool.ops.pipeline.steps.validate_steps (a dry run's)."""
    overrides = overrides or {}
    unknown = set(overrides) - set(recipe.sources)
    if unknown:
        raise UsageError(
            f"override for unknown source(s): {', '.join(sorted(unknown))}", expected=", ".join(sorted(recipe.sources))
        )
    out = Path(os.path.abspath(out or Path("build") / recipe.name))  # `-o .` has no name to extend
    work = out.with_name(out.name + ".build")
    sources = {
        n: resolve_source(s, overrides.get(n), token=token, builtins=builtins) for n, s in recipe.sources.items()
    }
    steps = [StepPlan(st, "", work, False, []) for st in recipe.steps]
    _key_steps(steps, work, {n: s.key for n, s in sources.items()})
    bp = BuildPlan(
        recipe, out, work, sources, steps, warnings=[_unhashed_warning(n, s) for n, s in sources.items() if s.unhashed]
    )
    return bp


def _key_steps(steps: list[StepPlan], work: Path, keys: dict[str, str]) -> None:
    """Each step's key from its op, `with` section, inputs' keys and qtool's version; its directory and
    whether a finished output with that key is there. `keys`: the sources' keys (the steps' are added)."""
    from qtool import __version__

    for sp in steps:
        sp.input_keys = [keys[i] for i in sp.step.inputs]
        sp.key = sha({"op": sp.step.op.value, "with": sp.step.params, "inputs": sp.input_keys, "qtool": __version__})
        sp.dir = work / "steps" / f"{sp.step.id}-{sp.key[:12]}"
        sp.cached = step_finished(sp.dir, sp.key)
        keys[sp.step.id] = sp.key


def step_finished(d: Path, key: str) -> bool:
    """A step output is reused only when its marker has this key AND every file it recorded is still
    there with its size and mtime (an artifact edited through a shared hard link re-runs the step)."""
    try:
        marker = json.loads((d / STEP_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("key") == key and files_unchanged(d, marker.get("files"))


def file_stats(root: Path, *, strict: bool = False) -> dict[str, list[int]]:
    """rel path -> [size, mtime_ns] of every file under `root` (markers excluded); `strict` adds the ctime
    and inode (what no user tool puts back after an edit; for files nothing else links, since a hard link
    moves the ctime: the published artifact, not the step cache)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != STEP_MARKER:
            st = p.stat()
            out[p.relative_to(root).as_posix()] = [st.st_size, st.st_mtime_ns] + (
                [st.st_ctime_ns, st.st_ino] if strict else []
            )
    return out


def files_unchanged(root: Path, recorded: dict | None, *, strict: bool = False) -> bool:
    return isinstance(recorded, dict) and file_stats(root, strict=strict) == recorded


def input_path(bp: BuildPlan, ref: str) -> Path | None:
    """Where a source or step output is (None: a hub source not yet materialized / step not yet run)."""
    if ref in bp.sources:
        return bp.sources[ref].path
    sp = next(s for s in bp.steps if s.step.id == ref)
    if sp.step.op is Op.VERIFY:
        return input_path(bp, sp.step.inputs[0])
    return sp.dir if (sp.dir / STEP_MARKER).exists() else None
