"""Execute a BuildPlan: skip finished steps, run the rest in order, publish the final artifact with its
provenance chain in qtool-manifest.json."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from qtool.build_recipes import Op
from qtool.errors import WriteError
from qtool.ops.build.plan import STEP_MARKER, BuildPlan, StepPlan, input_path
from qtool.ops.build.steps import RUNNERS, _link_tree

MANIFEST = "qtool-manifest.json"


def _mark(sp: StepPlan, report: dict, seconds: float) -> None:
    from qtool.io.jsonio import atomic_write_text

    sp.dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(sp.dir / STEP_MARKER, json.dumps(
        {"key": sp.key, "step": sp.step.to_json(), "input_keys": sp.input_keys, "seconds": round(seconds, 3),
         "report": report}, indent=1, default=str) + "\n")


def _gc(sp: StepPlan) -> None:
    """Remove older outputs of the same step id (other keys): the work dir stays bounded."""
    steps = sp.dir.parent
    for d in steps.glob(f"{sp.step.id}-*"):
        if d != sp.dir and d.is_dir() and len(d.name) == len(sp.dir.name):
            shutil.rmtree(d, ignore_errors=True)


def run(bp: BuildPlan, *, resume: bool = False, progress: bool = False, token: str | None = None,
        command: str | None = None, force: bool = False) -> dict:
    ctx = {"resume": resume, "progress": progress, "token": token, "command": command}
    if bp.out.exists() and not force and not _ours(bp.out):
        raise WriteError("output exists and was not made by qtool build", path=bp.out,
                         hint="choose another -o, or pass --force")
    ran, skipped = [], []
    chain = []
    for sp in bp.steps:
        if sp.cached:
            skipped.append(sp.step.id)
            info = json.loads((sp.dir / STEP_MARKER).read_text())
        else:
            if sp.dir.exists() and not resume:
                shutil.rmtree(sp.dir)
            t0 = time.perf_counter()
            report = RUNNERS[sp.step.op](bp, sp, ctx)
            dt = time.perf_counter() - t0
            _mark(sp, report, dt)
            _gc(sp)
            sp.cached = True
            ran.append(sp.step.id)
            info = json.loads((sp.dir / STEP_MARKER).read_text())
        chain.append({"id": sp.step.id, "op": sp.step.op.value, "key": sp.key, "inputs": list(sp.step.inputs),
                      "input_keys": sp.input_keys, "with": sp.step.params, "seconds": info.get("seconds"),
                      "report": info.get("report")})
    final = _publish(bp, chain)
    return {"recipe": bp.recipe.name, "out": str(bp.out), "ran": ran, "skipped": skipped,
            "final_key": bp.final_key, "published": final}


def _ours(out: Path) -> bool:
    try:
        return "build" in json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False


def _publish(bp: BuildPlan, chain: list[dict]) -> bool:
    """Hard-link the artifact step's output to `out` with the build provenance; False when up to date."""
    from qtool import __version__
    from qtool.io.atomic_dir import commit_output, prepare_output
    from qtool.io.jsonio import atomic_write_text

    if _ours(bp.out):
        try:
            if json.loads((bp.out / MANIFEST).read_text())["build"]["final_key"] == bp.final_key:
                return False
        except (OSError, ValueError, KeyError):
            pass
    src = input_path(bp, bp.recipe.artifact_step.id)
    assert src is not None
    partial = prepare_output(bp.out, force=True)
    _link_tree(src, partial)
    build = {
        "recipe": bp.recipe.name,
        "recipe_path": bp.recipe.path,
        "final_key": bp.final_key,
        "sources": {n: s.to_json() for n, s in bp.sources.items()},
        "steps": chain,
    }
    mpath = partial / MANIFEST
    if mpath.exists():
        # the producing op's manifest (per-tensor origins) stays; the build chain is added to it. Replace
        # the hard link by a new file so the step's own copy is not modified.
        manifest = json.loads(mpath.read_text())
        mpath.unlink()
    else:
        manifest = {"qtool_version": __version__, "operation": "build"}
    manifest["build"] = build
    if (src / MANIFEST).exists() and bp.recipe.artifact_step.op is not Op.ASSEMBLE:
        manifest.setdefault("note", "per-tensor origins are those of the earliest step that wrote them")
    atomic_write_text(mpath, json.dumps(manifest, indent=1, default=str) + "\n")
    commit_output(partial, bp.out)
    return True
