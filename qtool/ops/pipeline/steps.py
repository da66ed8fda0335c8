"""One function per build op, dispatched by an explicit table. Each runner writes the step's output into
`dir` (created by the op itself, atomically) and returns a small JSON report; validators call the op's own
plan() (headers and configs only) for `--dry-run`. Ops whose module is not installed fail with a clear
error naming the module."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path

from qtool.build_recipes import Op, SourceKind
from qtool.errors import PlanError, VerificationError
from qtool.ops.contract import OpSpec, options_from
from qtool.ops.pipeline.plan import STEP_MARKER, BuildPlan, StepPlan, input_path


def op_module(op: Op, module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise PlanError(
                f"build op {op.value!r} is not available in this qtool ({module} is missing)",
                hint="update qtool, or remove the step from the recipe",
            ) from None
        raise


def materialize(
    bp: BuildPlan,
    ref: str,
    *,
    for_assemble: dict | None = None,
    token: str | None = None,
    progress: bool = False,
    stand_ins: dict | None = None,
) -> Path:
    """A local directory for an input: sources are downloaded/fetched here (hub), steps must have run.
    `stand_ins`: header-only stand-ins of Hub sources (qtool.hub.headers) for planning (--dry-run)."""
    p = input_path(bp, ref)
    if p is not None:
        return p
    if stand_ins and ref in stand_ins:
        return stand_ins[ref]
    if ref not in bp.sources:
        raise PlanError(f"input {ref!r} has not been built", hint="run without --dry-run")
    rs = bp.sources[ref]
    src = rs.source
    assert src.kind is SourceKind.HUB
    from qtool.hub.resolve import HubSpec

    spec = HubSpec(src.ref, rs.identity["commit"])
    if src.tensors == "assemble" and for_assemble is not None:
        from qtool.hub.resolve import fetch_tensor_patterns
        from qtool.ops.assemble.model import bf16_source_patterns

        pats = bf16_source_patterns(
            for_assemble.get("bf16_expert_layers") or (),
            for_assemble.get("mtp", "auto"),
            for_assemble.get("bf16_shared_expert_layers"),
        )
        rs.path = fetch_tensor_patterns(spec, pats, token=token, progress=progress)
        return rs.path
    from qtool.hub.download import snapshot

    rs.path = snapshot(spec, token=token, progress=progress)
    return rs.path


# ---- runners ---------------------------------------------------------------------------------------
# Every op runs on the one op contract (qtool.ops.contract): its step makes the op's options from the
# recipe's `with` keys plus the step's input and output directory, then plan -> execute. The table says,
# per op, which module and options class, and how the step's inputs become options.


def _single_input(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    return {
        "checkpoint": materialize(bp, sp.step.inputs[0], token=ctx.get("token"), stand_ins=ctx.get("stand_ins")),
        "out": sp.dir,
    }


def _assemble_inputs(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    from qtool.io.writer import parse_size

    p, kw = (
        sp.step.params,
        {"token": ctx.get("token"), "progress": ctx.get("progress", False), "stand_ins": ctx.get("stand_ins")},
    )
    mss = p.get("max_shard_size")
    out = {
        "nvfp4": materialize(bp, p["nvfp4"], **kw),
        "bf16": materialize(bp, p["bf16"], for_assemble=p, **kw),
        "out": sp.dir,
        "max_shard_size": parse_size(str(mss)) if mss is not None else None,
        "bf16_expert_layers": tuple(int(x) for x in p.get("bf16_expert_layers") or ()),
    }
    if p.get("bf16_shared_expert_layers") is not None:  # absent: every layer's (the default)
        out["bf16_shared_expert_layers"] = tuple(int(x) for x in p["bf16_shared_expert_layers"])
    return out


def _download_inputs(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    from qtool.hub.resolve import HubSpec

    rs = bp.sources[sp.step.inputs[0]]
    return {"spec": HubSpec(rs.source.ref, rs.identity["commit"]), "out": sp.dir, "token": ctx.get("token")}


def _verify_inputs(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    return {"checkpoint": materialize(bp, sp.step.inputs[0], token=ctx.get("token"), stand_ins=ctx.get("stand_ins"))}


@dataclasses.dataclass(frozen=True)
class StepOp:
    module: str
    options: str  # the options class's name in `module`
    inputs: Callable[[BuildPlan, StepPlan, dict], dict]  # the options the step fixes (paths, output)
    writes: bool = True  # False: the op writes nothing (verify); its report's `ok` decides the step
    plan: str = "plan"  # the module's plan / execute functions
    execute: str = "execute"


STEP_OPS: dict[Op, StepOp] = {
    Op.DOWNLOAD: StepOp("qtool.ops.download", "DownloadOptions", _download_inputs),
    Op.QUANTIZE: StepOp("qtool.ops.quantize", "QuantizeOptions", _single_input),
    Op.CONVERT: StepOp("qtool.ops.convert", "ConvertOptions", _single_input),
    Op.ASSEMBLE: StepOp("qtool.ops.assemble", "HybridOptions", _assemble_inputs, plan="plan_hybrid"),
    Op.CALIBRATE_KV: StepOp("qtool.ops.calibrate_kv", "CalibrateKvOptions", _single_input),
    Op.PATCH_CONFIG: StepOp("qtool.ops.patch_config", "PatchOptions", _single_input),
    Op.VERIFY: StepOp("qtool.ops.verify", "VerifyOptions", _verify_inputs, writes=False),
}


def contract_spec(op: Op) -> OpSpec:
    row = STEP_OPS[op]
    mod = op_module(op, row.module)
    return OpSpec(getattr(mod, row.options), getattr(mod, row.plan), getattr(mod, row.execute))


def _tuples(params: dict) -> dict:
    """A recipe's lists as the tuples a frozen options dataclass holds."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}


def step_options(bp: BuildPlan, sp: StepPlan, ctx: dict, **fixed):
    """The op's options for this step: the recipe's `with` keys, the step's inputs and output, and (for
    a writing op) --force on its own cache directory, --resume and the command line from `ctx`."""
    row, spec = STEP_OPS[sp.step.op], contract_spec(sp.step.op)
    params = _tuples(sp.step.params)  # the fixed values below take precedence (input refs -> paths)
    names = {f.name for f in dataclasses.fields(spec.options)}
    given = row.inputs(bp, sp, ctx)
    if row.writes:
        given.update(force=True, resume=ctx.get("resume", False), command=ctx.get("command"))
    given.update(fixed)
    return options_from(spec.options, params, **{k: v for k, v in given.items() if k in names})


def _linked_local_source(src: Path, sp: StepPlan) -> dict:
    """A download step whose source is local (a path, or a Hub source overridden by one): the step output
    is links of its files, in the build's own cache (never written through: qtool.io.files)."""
    from qtool.io.files import LinkMode, Placer, link_tree
    from qtool.io.output import OutputDir

    with OutputDir(sp.dir, sources=[src], force=True, replace_any=True) as tx:
        link_tree(src, tx.partial, Placer(LinkMode.AUTO), skip=(STEP_MARKER,))
        tx.commit()
    return {"linked_from": str(src)}


def run_step(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    """Run one build step: options -> plan -> execute (a verify step that finds errors fails the build)."""
    op = sp.step.op
    if op is Op.DOWNLOAD:
        ref = sp.step.inputs[0]
        if ref not in bp.sources or bp.sources[ref].source.kind is not SourceKind.HUB or bp.sources[ref].overridden:
            return _linked_local_source(materialize(bp, ref), sp)
    spec = contract_spec(op)
    opts = step_options(bp, sp, ctx)
    report = spec.execute(spec.plan(opts))
    if getattr(report, "ok", True) is False:
        errs = report.errors()
        raise VerificationError(
            f"verify step {sp.step.id!r}: {len(errs)} error(s)",
            path=opts.checkpoint,
            got="; ".join(getattr(e, "message", str(e)) for e in errs[:3]),
            hint=f"see `qtool verify {opts.checkpoint}` for the fixes",
        )
    return _step_summary(op, report.to_json())


def _step_summary(op: Op, rep: dict) -> dict:
    """The few figures a build step records of its op's report."""
    if op is Op.VERIFY:
        return {"ok": rep["ok"], "findings": len(rep["findings"])}
    if op is Op.DOWNLOAD:
        return {"commit": rep.get("commit"), "bytes": rep.get("bytes")}
    if op is Op.PATCH_CONFIG:
        return {"fixes": rep["fixes"], "written": rep["written"]}
    return rep


RUNNERS: dict[Op, Callable[[BuildPlan, StepPlan, dict], dict]] = {op: run_step for op in STEP_OPS}


# ---- dry-run validation ----------------------------------------------------------------------------


def _hub_stand_ins(bp: BuildPlan, refs) -> dict[str, Path]:
    """Header-only stand-ins (qtool.hub.headers) of the Hub sources among `refs` not downloaded yet, so a
    --dry-run plans the first steps without downloading them; a source that cannot be read now (offline,
    not cached) is left out and its step waits."""
    from qtool.hub.headers import remote_headers
    from qtool.hub.resolve import HubError, HubSpec

    out = {}
    for ref in refs:
        rs = bp.sources.get(ref)
        if rs is None or rs.source.kind is not SourceKind.HUB or rs.overridden or input_path(bp, ref) is not None:
            continue
        try:
            out[ref] = remote_headers(HubSpec(rs.source.ref, rs.identity["commit"]))[0]
        except HubError:
            continue
    return out


def validate_steps(bp: BuildPlan) -> BuildPlan:
    """Each step's validation (validate_step), on the plan: what a dry run shows."""
    for sp in bp.steps:
        sp.validation = validate_step(bp, sp)
    return bp


def validate_step(bp: BuildPlan, sp: StepPlan) -> dict:
    """Run the op's own plan() where its inputs are already local; otherwise say what it waits for."""
    st = sp.step
    if sp.cached:
        return {"status": "cached"}
    if st.op is Op.DOWNLOAD:
        return {"status": "ready"} if all(i in bp.sources for i in st.inputs) else {"status": "waits"}
    stand_ins = _hub_stand_ins(bp, st.inputs)
    waiting = [i for i in st.inputs if input_path(bp, i) is None and i not in stand_ins]
    if waiting:
        return {"status": "waits", "for": waiting}
    spec = contract_spec(st.op)
    planned = spec.plan(step_options(bp, sp, {"stand_ins": stand_ins}))
    if st.op is Op.VERIFY:
        rep = spec.execute(planned)  # verify writes nothing: its checks are its plan's validation
        return {"status": "planned", "ok": rep.ok, "errors": len(rep.errors())}
    if st.op is Op.ASSEMBLE:
        return {
            "status": "planned",
            "shards": len(planned.shards),
            "mtp": planned.mtp_action,
            "bf16_tensors": sum(1 for s in planned.shards for t in s.tensors if t.origin.source == "bf16"),
            "warnings": planned.warnings,
        }
    if st.op is Op.PATCH_CONFIG:
        return {"status": "planned", "fixes": [r.__dict__ for r in planned.results]}
    summary = planned.to_json()
    if st.op is Op.CONVERT:
        return {"status": "planned", **summary}
    keys = {"full_attention_layers": "layers", "config_changes": "changes", "warnings": "warnings"}
    return {"status": "planned", **{short: summary[k] for k, short in keys.items() if k in summary}}
