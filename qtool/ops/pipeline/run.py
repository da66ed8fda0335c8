"""Execute a BuildPlan: skip finished steps, run the rest in order, publish the final artifact with its
provenance chain in qtool-manifest.json."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from qtool.build_recipes import Op
from qtool.errors import Interrupted, WriteError
from qtool.io.digest_cache import files_in, user_cache
from qtool.io.files import LinkMode, Placer, copy_file
from qtool.io.jsonio import atomic_write_text
from qtool.io.manifest import RUN
from qtool.io.output import MANIFEST_NAME as MANIFEST
from qtool.io.output import (
    OutputDir,
    OutputLock,
    check_no_overlap,
    check_replaceable,
    lock_for,
    made_by_qtool,
    output_files,
    source_file_mode,
)
from qtool.notices import tell
from qtool.ops.pipeline.plan import (
    STEP_MARKER,
    BuildPlan,
    StepPlan,
    file_stats,
    files_unchanged,
    hash_sources,
    input_path,
    step_finished,
)
from qtool.ops.pipeline.steps import RUNNERS

PUBLISHED = "published.json"  # in DIR.build/: what was published, to notice an edited artifact


def _mark(sp: StepPlan, report: dict, seconds: float) -> None:
    sp.dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        sp.dir / STEP_MARKER,
        json.dumps(
            {
                "key": sp.key,
                "step": sp.step.to_json(),
                "input_keys": sp.input_keys,
                "seconds": round(seconds, 3),
                "report": report,
                "files": file_stats(sp.dir),
            },
            indent=1,
            default=str,
        )
        + "\n",
    )


def _gc(bp: BuildPlan, sp: StepPlan) -> None:
    """Remove older outputs of the same step id (other keys): the work dir stays bounded. Their links into
    the step's inputs go with them, which moves those files' ctimes: their sha256 cache entries are kept
    (qtool.io.digest_cache), or the next build would hash the inputs of every step it re-runs again."""
    steps = sp.dir.parent
    old = [d for d in steps.glob(f"{sp.step.id}-*") if d != sp.dir and d.is_dir() and len(d.name) == len(sp.dir.name)]
    if not old:
        return
    inputs = [input_path(bp, ref) for ref in sp.step.inputs]
    with user_cache().keeping([f for root in inputs if root is not None for f in files_in(root)]):
        for d in old:
            shutil.rmtree(d, ignore_errors=True)


def run(
    bp: BuildPlan,
    *,
    resume: bool = False,
    progress: bool = False,
    token: str | None = None,
    command: str | None = None,
    force: bool = False,
) -> dict:
    ctx = {"resume": resume, "progress": progress, "token": token, "command": command}
    # refused before any step runs (publishing would refuse it only at the end)
    check_no_overlap(bp.out, [s.path for s in bp.sources.values() if s.path is not None])
    # OUT's own lock, the one every writer of OUT takes, held for the whole run: no other command (a second
    # build, an `assemble -o OUT`) writes OUT meanwhile, and the steps' reuse is decided again under it
    bp.out.parent.mkdir(parents=True, exist_ok=True)
    with lock_for(bp.out) as lock:
        check_build_output(bp, force=force)
        hash_sources(bp)  # planning read no data: a local source without digests on record is read now
        try:
            for sp in bp.steps:
                sp.cached = step_finished(sp.dir, sp.key)
            report = _run_steps(bp, ctx, resume, force, lock)
        finally:
            # the steps linked the sources' files (and removed old steps' links), which moved their ctime: a
            # failed build too, so the next plan still finds their digests on record (see dir_fingerprint)
            for s in bp.sources.values():
                if s.refresh is not None:
                    s.refresh()
    return report


def _run_steps(bp: BuildPlan, ctx: dict, resume: bool, force: bool, lock: OutputLock) -> dict:
    ran, skipped = [], []
    chain: list[dict] = []
    timings: list[dict] = []
    for sp in bp.steps:
        if sp.cached:
            tell(f"step {sp.step.id} ({sp.step.op.value}): unchanged, reused")
            skipped.append(sp.step.id)
            info = json.loads((sp.dir / STEP_MARKER).read_text())
        else:
            if sp.dir.exists() and not resume:
                shutil.rmtree(sp.dir)
            t0 = time.perf_counter()
            what = f"step {sp.step.id} ({sp.step.op.value})"
            tell(f"{what}: running")
            try:
                report = RUNNERS[sp.step.op](bp, sp, ctx)
            except KeyboardInterrupt:
                raise Interrupted(what) from None
            dt = time.perf_counter() - t0
            tell(f"{what}: done in {dt:.1f} s")
            _mark(sp, report, dt)
            _gc(bp, sp)
            sp.cached = True
            ran.append(sp.step.id)
            info = json.loads((sp.dir / STEP_MARKER).read_text())
        chain.append(
            {
                "id": sp.step.id,
                "op": sp.step.op.value,
                "key": sp.key,
                "inputs": list(sp.step.inputs),
                "input_keys": sp.input_keys,
                "with": sp.step.params,
            }
        )
        # the step's report and time differ between a resumed and an uninterrupted build: the `run` section
        timings.append({"id": sp.step.id, "seconds": info.get("seconds"), "report": info.get("report")})
    placed = _publish(bp, chain, timings, force, lock)
    return {
        "recipe": bp.recipe.name,
        "out": str(bp.out),
        "ran": ran,
        "skipped": skipped,
        "final_key": bp.final_key,
        "published": placed is not None,
        "shards_placed": placed or {},
    }


def same_recipes_artifact(out: Path, bp: BuildPlan) -> bool:
    """Whether `out` is what a build of this recipe (by its name) published: the one thing a build replaces
    without --force (its own earlier artifact, the recipe edited or its sources moved on since)."""
    if not made_by_qtool(out):
        return False
    try:
        build = json.loads((out / MANIFEST).read_text()).get("build")
    except (OSError, ValueError):
        return False
    return isinstance(build, dict) and build.get("recipe") == bp.recipe.name


def check_build_output(bp: BuildPlan, *, force: bool) -> None:
    """The output rule every writer follows (qtool.io.output.check_replaceable), for a build: an existing
    OUT is replaced without --force only when this recipe's build published it; anything else qtool made
    needs --force, and what qtool did not make (or files its manifest does not list) is never replaced."""
    if not os.path.lexists(bp.out):
        return
    ours = same_recipes_artifact(bp.out, bp)
    if (
        not force
        and not ours
        and bp.out.is_dir()
        and not bp.out.is_symlink()
        and any(bp.out.iterdir())
        and made_by_qtool(bp.out)
    ):
        raise WriteError(
            f"the output holds {_made_by(bp.out)}, not an artifact of recipe {bp.recipe.name!r}",
            path=bp.out,
            hint="choose another -o, or pass --force to replace it",
        )
    check_replaceable(bp.out, force=force or ours)


def _made_by(out: Path) -> str:
    """What made the qtool output at `out`, in words (for the refusal)."""
    try:
        m = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return "another qtool output"
    build = m.get("build")
    if isinstance(build, dict):
        return f"the artifact of recipe {build.get('recipe')!r}"
    return f"the output of `qtool {m.get('operation', '?')}`"


def _publish(
    bp: BuildPlan, chain: list[dict], timings: list[dict], force: bool, lock: OutputLock
) -> dict[str, int] | None:
    """Publish the artifact step's output at `out` with the build provenance; None when up to date (same
    final key and every published file as it was published), else the shards' bytes by how they were placed
    ({"reflink": B} or {"copy": B}: a copy takes the artifact's size again on disk). Side files (what people edit) are
    copies, so editing them cannot change the step cache; shards are reflinks, else copies, never hard links (an
    edit of a published shard through a shared inode would corrupt the step cache too). The record of
    what was published holds each file's size, mtime, ctime and inode: a same-size edit with the mtime
    put back still moves the ctime, so it is noticed and the artifact is published again."""
    record = bp.work / PUBLISHED
    ours = same_recipes_artifact(bp.out, bp)
    if ours:
        try:
            same_key = json.loads((bp.out / MANIFEST).read_text())["build"]["final_key"] == bp.final_key
            if same_key and files_unchanged(bp.out, json.loads(record.read_text()), strict=True):
                return None
        except (OSError, ValueError, KeyError):
            pass
    src = input_path(bp, bp.recipe.artifact_step.id)
    assert src is not None
    build = {
        "recipe": bp.recipe.name,
        "recipe_path": bp.recipe.path,
        "final_key": bp.final_key,
        "sources": {n: s.to_json() for n, s in bp.sources.items()},
        "steps": chain,
    }
    inputs = [s.path for s in bp.sources.values() if s.path is not None]
    # the rule checked as the build began, again: what appeared at OUT meanwhile (another build's artifact,
    # a user's files) is replaced only as it would have been then
    with OutputDir(bp.out, sources=inputs, force=force or ours, file_mode=source_file_mode(src), lock=lock) as tx:
        shards = Placer(LinkMode.OWN_INODE, file_mode=tx.file_mode)
        placed: dict[str, int] = {}
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_dir() or rel.name in (STEP_MARKER, MANIFEST) or any(x.startswith(".") for x in rel.parts):
                continue
            dst = tx.partial / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if p.suffix == ".safetensors":
                how = shards.place(p, dst)  # a reflink (no new disk space) where the filesystem has them
                placed[how] = placed.get(how, 0) + p.stat().st_size
            else:
                copy_file(p, dst, tx.file_mode)
        manifest = json.loads((src / MANIFEST).read_text()) if (src / MANIFEST).exists() else {"operation": "build"}
        manifest["build"] = build
        manifest[RUN] = {"steps": timings}  # qtool.io.manifest.RUN: what another run of the build may change
        # shards' digests carry over from the producing op (the same bytes); side files are re-hashed
        # (a patch-config step changed configs after the manifest was written)
        manifest["files"] = output_files(
            tx.partial,
            {
                k: v["sha256"]
                for k, v in (manifest.get("files") or {}).items()
                if isinstance(v, dict) and k.endswith(".safetensors") and isinstance(v.get("sha256"), str)
            },
        )
        if (src / MANIFEST).exists() and bp.recipe.artifact_step.op is not Op.ASSEMBLE:
            manifest.setdefault("note", "per-tensor origins are those of the earliest step that wrote them")
        atomic_write_text(tx.partial / MANIFEST, json.dumps(manifest, indent=1, default=str) + "\n")
        tx.commit()
    atomic_write_text(record, json.dumps(file_stats(bp.out, strict=True)) + "\n")
    return placed
