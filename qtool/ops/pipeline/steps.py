"""One function per build op, dispatched by an explicit table. Each runner writes the step's output into
`dir` (created by the op itself, atomically) and returns a small JSON report; validators call the op's own
plan() (headers and configs only) for `--dry-run`. Ops whose module is not installed fail with a clear
error naming the module."""

from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager
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
            raise PlanError(f"build op {op.value!r} is not available in this qtool ({module} is missing)",
                            hint="update qtool, or remove the step from the recipe") from None
        raise


def materialize(bp: BuildPlan, ref: str, *, for_assemble: dict | None = None, token: str | None = None,
                progress: bool = False) -> Path:
    """A local directory for an input: sources are downloaded/fetched here (hub), steps must have run."""
    p = input_path(bp, ref)
    if p is not None:
        return p
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

        pats = bf16_source_patterns(for_assemble.get("bf16_expert_layers") or (), for_assemble.get("mtp", "auto"))
        rs.path = fetch_tensor_patterns(spec, pats, token=token, progress=progress)
        return rs.path
    from qtool.hub.download import snapshot

    rs.path = snapshot(spec, token=token, progress=progress)
    return rs.path


# ---- runners ---------------------------------------------------------------------------------------


def _assemble_opts(bp: BuildPlan, sp: StepPlan, out: Path, **kw):
    from qtool.io.writer import parse_size
    from qtool.ops.assemble import HybridOptions, LinkMode, MtpMode

    p = sp.step.params
    nv = materialize(bp, p["nvfp4"], **kw)
    bf = materialize(bp, p["bf16"], for_assemble=p, **kw)
    mss = p.get("max_shard_size")
    return HybridOptions(nvfp4=nv, bf16=bf, out=out, bf16_expert_layers=tuple(int(x) for x in p.get("bf16_expert_layers") or ()),
                         mtp=MtpMode(p.get("mtp", "auto")), link=LinkMode(p.get("link", "auto")),
                         max_shard_size=parse_size(str(mss)) if mss is not None else None)


def run_assemble(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    from qtool.ops.assemble import assemble_hybrid

    opts = _assemble_opts(bp, sp, sp.dir, token=ctx.get("token"), progress=ctx.get("progress", False))
    opts = dataclasses.replace(opts, force=True, resume=ctx.get("resume", False), command=ctx.get("command"))
    _, result = assemble_hybrid(opts)
    return result.to_json()


# Ops on the one op contract (qtool.ops.contract): {op: (module, options class)}; their step runs as
# options_from(`with` + the step's input and output) -> plan -> execute.
CONTRACT_OPS: dict[Op, tuple[str, str]] = {
    Op.CALIBRATE_KV: ("qtool.ops.calibrate_kv", "CalibrateKvOptions"),
    Op.QUANTIZE: ("qtool.ops.quantize", "QuantizeOptions"),
    Op.CONVERT: ("qtool.ops.convert", "ConvertOptions"),
}


def contract_spec(op: Op) -> OpSpec:
    module, options = CONTRACT_OPS[op]
    mod = op_module(op, module)
    return OpSpec(getattr(mod, options), mod.plan, mod.execute)


def run_contract_op(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    spec = contract_spec(sp.step.op)
    src = materialize(bp, sp.step.inputs[0], token=ctx.get("token"))
    opts = options_from(spec.options, sp.step.params, checkpoint=src, out=sp.dir, force=True,
                        resume=ctx.get("resume", False), command=ctx.get("command"))
    return spec.execute(spec.plan(opts)).to_json()


@contextmanager
def _linked_step_dir(src: Path, sp: StepPlan):
    """A step output that starts as links of its input's files (patch-config, a local download source):
    an OutputDir in the build's own cache, with `src` linked into its partial directory. Files are
    replaced there through new inodes only (qtool.io.files), so the input is never modified."""
    from qtool.io.files import LinkMode, Placer, link_tree
    from qtool.io.output import OutputDir

    with OutputDir(sp.dir, sources=[src], force=True, replace_any=True) as tx:
        link_tree(src, tx.partial, Placer(LinkMode.AUTO), skip=(STEP_MARKER,))
        yield tx


def _tuples(params: dict) -> dict:
    """A recipe's lists as the tuples a frozen options dataclass holds."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}


def run_patch_config(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    mod = op_module(Op.PATCH_CONFIG, "qtool.ops.patch_config")
    src = materialize(bp, sp.step.inputs[0], token=ctx.get("token"))
    with _linked_step_dir(src, sp) as tx:
        p = sp.step.params
        plan = mod.plan(options_from(mod.PatchOptions, _tuples(p), checkpoint=tx.partial))
        written = mod.apply(plan, in_transaction=True)
        tx.commit()
    return {"fixes": [r.__dict__ for r in plan.results], "written": written}


def _verify_opts(p: dict):
    mod = op_module(Op.VERIFY, "qtool.ops.verify")
    return mod, mod.VerifyOptions(**{k: v for k, v in p.items()})


def run_verify(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    mod, opts = _verify_opts(sp.step.params)
    src = materialize(bp, sp.step.inputs[0], token=ctx.get("token"))
    rep = mod.verify(src, opts)
    out = rep.to_json()
    if not rep.ok:
        errs = rep.errors()
        raise VerificationError(f"verify step {sp.step.id!r}: {len(errs)} error(s)", path=src,
                                got="; ".join(getattr(e, "message", str(e)) for e in errs[:3]),
                                hint=f"see `qtool verify {src}` for the fixes")
    return {"ok": out["ok"], "findings": len(out["findings"])}


def run_download(bp: BuildPlan, sp: StepPlan, ctx: dict) -> dict:
    ref = sp.step.inputs[0]
    if ref not in bp.sources or bp.sources[ref].source.kind is not SourceKind.HUB or bp.sources[ref].overridden:
        src = materialize(bp, ref)
        with _linked_step_dir(src, sp) as tx:
            tx.commit()
        return {"linked_from": str(src)}
    from qtool.hub.resolve import HubSpec
    from qtool.ops import download as dl

    rs = bp.sources[ref]
    p = sp.step.params
    opts = dl.DownloadOptions(spec=HubSpec(rs.source.ref, rs.identity["commit"]), out=sp.dir,
                              include=list(p.get("include", [])), tensors=list(p.get("tensors", [])),
                              token=ctx.get("token"), force=True, resume=ctx.get("resume", False),
                              command=ctx.get("command"))
    rep = dl.execute(dl.plan(opts), progress=ctx.get("progress", False)).to_json()
    return {"commit": rep.get("commit"), "bytes": rep.get("bytes")}


RUNNERS: dict[Op, Callable[[BuildPlan, StepPlan, dict], dict]] = {
    Op.DOWNLOAD: run_download,
    Op.QUANTIZE: run_contract_op,
    Op.CONVERT: run_contract_op,
    Op.ASSEMBLE: run_assemble,
    Op.CALIBRATE_KV: run_contract_op,
    Op.PATCH_CONFIG: run_patch_config,
    Op.VERIFY: run_verify,
}


# ---- dry-run validation ----------------------------------------------------------------------------


def validate_step(bp: BuildPlan, sp: StepPlan) -> dict:
    """Run the op's own plan() where its inputs are already local; otherwise say what it waits for."""
    st = sp.step
    waiting = [i for i in st.inputs if input_path(bp, i) is None]
    if sp.cached:
        return {"status": "cached"}
    if waiting:
        return {"status": "waits", "for": waiting}
    if st.op is Op.ASSEMBLE:
        from qtool.ops.assemble import plan_hybrid

        hp = plan_hybrid(_assemble_opts(bp, sp, sp.dir))
        return {"status": "planned", "shards": len(hp.shards), "mtp": hp.mtp_action,
                "bf16_tensors": sum(1 for s in hp.shards for t in s.tensors if t.origin.source == "bf16"),
                "warnings": hp.warnings}
    src = input_path(bp, st.inputs[0])
    if st.op is Op.PATCH_CONFIG:
        mod = op_module(Op.PATCH_CONFIG, "qtool.ops.patch_config")
        p = st.params
        pp = mod.plan(options_from(mod.PatchOptions, _tuples(p), checkpoint=src))
        return {"status": "planned", "fixes": [r.__dict__ for r in pp.results]}
    if st.op is Op.VERIFY:
        mod, opts = _verify_opts(st.params)
        rep = mod.verify(src, opts)
        return {"status": "planned", "ok": rep.ok, "errors": len(rep.errors())}
    if st.op in CONTRACT_OPS:
        spec = contract_spec(st.op)
        planned = spec.plan(options_from(spec.options, st.params, checkpoint=src, out=sp.dir))
        summary = planned.to_json()
        if st.op is Op.CONVERT:
            return {"status": "planned", **summary}
        keys = {"full_attention_layers": "layers", "config_changes": "changes", "warnings": "warnings"}
        return {"status": "planned", **{short: summary[k] for k, short in keys.items() if k in summary}}
    return {"status": "ready"}
