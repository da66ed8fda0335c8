"""`qtool verify`: is this artifact ready to serve on the target with the chosen engines?

plan(VerifyOptions) (options validated, engines parsed) -> execute: checks from headers and configs (structure, engine
semantics per version, TP / MTP / KV constraints, memory fit) -> optional --deep pass over the data
(sha256 of every shard vs qtool-manifest.json, numeric scan). Library code: returns a VerifyReport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qtool.engines import EngineVersion, parse_version
from qtool.errors import UsageError
from qtool.findings import Code, Finding, Severity, error
from qtool.ops.verify.memory_fit import DEFAULT_GPUS, DEFAULT_UTILIZATION, Fit, Target

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class VerifyOptions:
    engine: str = "both"  # vllm | sglang | both | comma list of specs like vllm@0.17
    tp: int = 4
    gpus: str = DEFAULT_GPUS
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    # None: the one the artifact is served with (served_kv_cache_dtype), decided by verify itself, so that
    # serve-config and report judge a calibrated artifact once, with FP8, not once more to learn it is
    kv_cache_dtype: str | None = "auto"
    gpu_memory_utilization: float = DEFAULT_UTILIZATION
    mtp: int = 0
    deep: bool = False
    deep_workers: int | None = None
    checkpoint: Path | None = None  # the op contract's input (verify(path, opts) sets it)


@dataclass
class VerifyPlan:
    """The checked options: the engines to model and the GPUs to fit, and the checkpoint to judge."""

    options: VerifyOptions
    path: Path
    versions: list[EngineVersion]
    target: Target


@dataclass
class VerifyReport:
    path: str
    findings: list[Finding]
    fit: Fit | None
    engines: dict[str, dict]
    facts: dict = field(default_factory=dict)  # what serve-config needs: naming, vision, mtp, kv, quant
    deep: dict | None = None
    model_map: object = field(default=None, repr=False)  # the ModelMap (for serve-config); not serialized
    kv_cache_dtype: str = "auto"  # the KV-cache dtype it was judged with (VerifyOptions' None decided)

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.is_error]

    def to_json(self) -> dict:
        fit = None
        if self.fit is not None:
            fit = self.fit.to_json()
        out = {
            "ok": self.ok,
            "path": self.path,
            "findings": [f.to_json() for f in self.findings],
            "fit": fit,
            "engines": self.engines,
            "facts": self.facts,
        }
        if self.deep is not None:
            out["deep"] = self.deep
        return out


def parse_engines(spec: str) -> list[EngineVersion]:
    parts = ["vllm", "sglang"] if spec.strip().lower() == "both" else [s for s in spec.split(",") if s.strip()]
    if not parts:
        raise UsageError("--engine is empty", hint="vllm, sglang, both, or specs like vllm@0.17")
    return [parse_version(p.strip()) for p in parts]


def validate(opts: VerifyOptions) -> tuple[list[EngineVersion], Target]:
    versions = parse_engines(opts.engine)
    target = Target.parse(opts.gpus)
    if opts.tp < 1:
        raise UsageError("--tp must be >= 1", got=opts.tp)
    if opts.tp > target.num_gpus:
        raise UsageError(f"--tp {opts.tp} needs {opts.tp} GPUs, --gpus has {target.num_gpus}")
    if opts.kv_cache_dtype is not None and opts.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"--kv-cache-dtype {opts.kv_cache_dtype!r}", expected=KV_CACHE_DTYPES)
    if opts.mtp < 0:
        raise UsageError("--mtp must be >= 0", got=opts.mtp)
    for name in ("max_model_len", "max_num_seqs"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1", got=v)
    return versions, target


def served_kv_cache_dtype(asked: str | None, facts: dict) -> str:
    """The KV-cache dtype a launch uses (serve-config, and the report's launch lines and memory fit): the
    one asked for, else fp8 where the checkpoint carries calibrated scales, else the engine's auto."""
    if asked:
        return asked
    return "fp8" if facts.get("kv_scales_calibrated") else "auto"


def _kv_scales_calibrated(mm) -> bool:
    """Every full-attention layer has k/v scales, and they are calibrated (not the constant 1.0)."""
    return bool(mm.kv.layers) and mm.kv.calibrated is True and len(mm.kv.layers) == len(mm.full_attention)


def plan(opts: VerifyOptions) -> VerifyPlan:
    """The op contract's plan: options validated (usage errors, exit 2), the checkpoint's presence (exit 1)."""
    versions, target = validate(opts)
    path = opts.checkpoint
    if path is None or not Path(path).exists():
        from qtool.io.checkpoint import checkpoint_not_found

        raise checkpoint_not_found(path)  # bad input (exit 1), not a failed verification (exit 3)
    return VerifyPlan(opts, Path(path), versions, target)


def verify(path: str | Path, opts: VerifyOptions | None = None) -> VerifyReport:
    """plan + execute in one call: the report of `path` under `opts`."""
    import dataclasses

    return execute(plan(dataclasses.replace(opts or VerifyOptions(), checkpoint=Path(path))))


def execute(p: VerifyPlan) -> VerifyReport:
    """The op contract's execute: every check (headers and configs; the data too with --deep). Writes
    nothing; the report's `ok` says whether the artifact passed (the CLI and build steps exit 3 if not)."""
    from qtool.arch.model_map import build_map
    from qtool.arch.qwen35 import Group
    from qtool.io.quant_config import summarize
    from qtool.ops.verify import engine_rules, refusals, structure
    from qtool.ops.verify.memory_fit import memory_fit

    opts, path, versions, target = p.options, p.path, p.versions, p.target
    ckpt, findings = structure.open_checked(path)
    if ckpt is None:
        return VerifyReport(str(path), findings, None, {}, kv_cache_dtype=opts.kv_cache_dtype or "auto")
    mm = build_map(ckpt)
    summary = summarize(ckpt.config, ckpt.hf_quant_config)
    calibrated = _kv_scales_calibrated(mm)
    if opts.kv_cache_dtype is None:  # as served: every check below (and every fix line) with that dtype
        import dataclasses

        served = served_kv_cache_dtype(None, {"kv_scales_calibrated": calibrated})
        opts = dataclasses.replace(opts, kv_cache_dtype=served)
    kv_fp8 = opts.kv_cache_dtype == "fp8"

    findings += structure.structure_findings(mm)
    findings += structure.consistency_findings(mm, summary, kv_fp8=kv_fp8)
    findings += refusals.refusal_findings(ckpt, versions)
    dec_findings, engines, decisions = engine_rules.decision_findings(mm, summary, versions, mtp_requested=opts.mtp > 0)
    findings += dec_findings
    findings += engine_rules.tp_findings(mm, opts.tp, decisions, lambda works: _tp_fix(mm, works, opts, target))
    findings = engine_rules.per_engine_layout(findings, versions, mm)
    findings = engine_rules.per_engine_stale_scales(findings, versions, mm)
    findings += engine_rules.moe_scheme_findings(mm, versions)
    findings += engine_rules.input_scale_findings(mm)
    findings += engine_rules.attention_gate_findings(mm)
    findings += engine_rules.kv_ignored_findings(mm, summary, versions, opts.kv_cache_dtype)
    findings += engine_rules.mtp_findings(mm, opts.mtp)
    findings += engine_rules.kv_findings(mm, opts.kv_cache_dtype)

    fit = memory_fit(
        mm,
        tp=opts.tp,
        target=target,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        kv_cache_dtype=opts.kv_cache_dtype,
        mtp=opts.mtp,
        max_model_len=opts.max_model_len,
        max_num_seqs=opts.max_num_seqs,
    )
    if not fit.fits:
        findings.append(
            error(
                Code.DOES_NOT_FIT,
                None,
                f"does not fit on {opts.tp} x {fit.gpu_gib:.1f} GiB: {fit.reason}",
                _fit_fix(mm, fit, opts, target),
            )
        )
    remote_code = sorted(p.name for p in Path(ckpt.root).glob("*.py"))
    auto_map = (ckpt.config or {}).get("auto_map")
    if auto_map or remote_code:
        from qtool.findings import warning

        what = ", ".join(
            (
                [f"config.json auto_map ({', '.join(sorted(auto_map))})"]
                if isinstance(auto_map, dict) and auto_map
                else (["config.json auto_map"] if auto_map else [])
            )
            + remote_code
        )
        findings.append(
            warning(
                Code.REMOTE_CODE,
                None,
                f"the checkpoint carries code the engines would run with --trust-remote-code: {what}",
                "Qwen3.5 needs no remote code (both engines "
                "implement it); remove auto_map and the .py files unless you trust and need them",
            )
        )
    facts = {
        "remote_code": bool(auto_map),
        "architecture": ((ckpt.config or {}).get("architectures") or [None])[0],
        "naming": mm.naming.value,
        "vision": bool(mm.modules_in(Group.VISION)),
        "mtp": bool(mm.modules_in(Group.MTP)),
        "kv_scales_calibrated": calibrated,
        "quant_method": summary.quant_method or (summary.hf_quant_algo and "modelopt"),
        "quant_algo": summary.quant_algo or summary.hf_quant_algo,
        "rope_parameters": ckpt.text_config.get("rope_parameters") or ckpt.text_config.get("rope_scaling"),
        "max_position_embeddings": ckpt.text_config.get("max_position_embeddings"),
    }
    # the per-engine summaries count exactly the findings printed with that engine's tag
    for eng, counts in engines.items():
        if "units" in counts:
            counts["errors"] = sum(1 for f in findings if f.engine == eng and f.is_error)
            counts["warnings"] = sum(1 for f in findings if f.engine == eng and not f.is_error)
    report = VerifyReport(
        str(ckpt.root), findings, fit, engines, facts, model_map=mm, kv_cache_dtype=opts.kv_cache_dtype
    )
    if opts.deep and not any(f.code in (Code.BAD_HEADER, Code.TRUNCATED_SHARD) for f in findings):
        from qtool.ops.verify.deep import deep_check

        d = deep_check(ckpt, workers=opts.deep_workers)
        report.findings += d.findings
        report.deep = d.to_json()
    return report


__all__ = [
    "Code",
    "Finding",
    "Severity",
    "VerifyOptions",
    "VerifyPlan",
    "VerifyReport",
    "execute",
    "parse_engines",
    "plan",
    "served_kv_cache_dtype",
    "verify",
]


def _fit_fix(mm, fit, opts, target) -> str:
    """What makes it fit, by what does not: the weights and the reserve (more GPUs of the same size, the
    first TP that holds them; larger GPUs where the reserve alone does not fit), or the KV cache (a context
    or batch that fits, FP8 KV)."""
    from qtool.ops.verify.memory_fit import GIB

    more = _more_gpus(mm, opts, target)
    if fit.kv_cache_gib <= 0:  # the weights and the reserve alone exceed the budget
        budget = f"the budget ({fit.budget_gib:.1f} GiB per GPU)"
        over = (
            f"the weights alone ({fit.weights_per_gpu_gib:.1f} GiB per GPU) exceed {budget}"
            if fit.weights_per_gpu_gib >= fit.budget_gib
            else f"the weights ({fit.weights_per_gpu_gib:.1f} GiB per GPU) and the engine's reserve "
            f"({fit.reserve_gib:.1f} GiB per GPU: activations, CUDA graphs, workspaces) exceed {budget}"
        )
        if more:
            return f"{over}: serve on {more[0]} GPUs: {_verify_line(mm, opts, more[0], more[1])}"
        if fit.reserve_gib >= fit.budget_gib:  # no number of GPUs of this size holds the reserve
            least = (fit.reserve_gib + fit.weights_per_gpu_gib) / (fit.budget_gib / fit.gpu_gib)
            return f"{over}: GPUs of more than {least:.1f} GiB each (before any KV cache)"
        from qtool.ops.verify.engine_rules import TP_SIZES

        return (
            f"{over} at every TP up to {TP_SIZES[-1]}: a smaller checkpoint (NVFP4 routed experts, fewer BF16 "
            "pieces) or larger GPUs"
        )
    per_seq = fit.kv_bytes_per_token
    fixes = []
    length = opts.max_model_len or fit.max_model_len
    if per_seq and length:
        seqs = max(opts.max_num_seqs or 1, 1)
        room = int((fit.kv_cache_gib * GIB - seqs * fit.state_bytes_per_seq) // (seqs * per_seq))
        if room >= 1:
            fixes.append(f"--max-model-len {room} at most for {seqs} sequence(s)")
    if opts.max_num_seqs and per_seq and length:
        fit_seqs = int(fit.kv_cache_gib * GIB // (length * per_seq + fit.state_bytes_per_seq))
        if 1 <= fit_seqs < opts.max_num_seqs:
            fixes.append(f"--max-num-seqs {fit_seqs} at most at {length} tokens")
    if opts.kv_cache_dtype != "fp8":
        fixes.append("--kv-cache-dtype fp8 with calibrated scales (half the KV cache)")
    if more:  # more GPUs only where that fits (the KV heads stop splitting beyond their count)
        fixes.append(f"more GPUs (--gpus {more[1]} --tp {more[0]})")
    return "the KV cache does not fit: " + (", or ".join(fixes) if fixes else "no setting of these flags holds it")


def _more_gpus(mm, opts, target) -> tuple[int, str] | None:
    """(TP, its --gpus) of the first larger TP group of the same GPUs that fits, else None."""
    from qtool.ops.verify.engine_rules import TP_SIZES

    for t in (t for t in TP_SIZES if t > opts.tp):
        if _fits_at(mm, opts, target, t):
            return t, _gpus_for(opts, target, t)
    return None


def _tp_fix(mm, works: list[int], opts, target) -> str:
    """The tp-divisibility fix: of the TP sizes the checkpoint shards at (`works`), one that also fits in
    memory, since a TP that shards but does not fit only trades this error for does-not-fit. Preferred: the
    largest below the TP asked for (the user's GPUs, fewer of them), else the smallest above it (the fewest
    more GPUs of the same size); as a verify line with the user's other flags."""
    from qtool.ops.verify.engine_rules import TP_SIZES
    from qtool.ops.verify.memory_fit import GIB

    if not works:
        return f"no TP size of {', '.join(map(str, TP_SIZES))} shards this checkpoint: serve it on one GPU"
    shards = f"this checkpoint shards at TP {', '.join(map(str, works))}"
    for t in sorted((t for t in works if t < opts.tp), reverse=True) + sorted(t for t in works if t > opts.tp):
        if _fits_at(mm, opts, target, t):
            return f"serve at --tp {t} ({shards}): {_verify_line(mm, opts, t, _gpus_for(opts, target, t))}"
    return (
        f"{shards}, but it fits at none of them on GPUs of {target.gpu_bytes / GIB:.1f} GiB: a smaller "
        "checkpoint (NVFP4 routed experts, fewer BF16 pieces) or larger GPUs"
    )


def _fits_at(mm, opts, target, tp: int) -> bool:
    """Whether the checkpoint fits at `tp` on GPUs of the target's size, with the user's other settings."""
    from qtool.ops.verify.memory_fit import memory_fit

    return memory_fit(
        mm,
        tp=tp,
        target=Target(max(tp, target.num_gpus), target.gpu_bytes),
        gpu_memory_utilization=opts.gpu_memory_utilization,
        kv_cache_dtype=opts.kv_cache_dtype,
        mtp=opts.mtp,
        max_model_len=opts.max_model_len,
        max_num_seqs=opts.max_num_seqs,
    ).fits


def _gpus_for(opts, target, tp: int) -> str:
    """--gpus for serving at `tp`: the user's own when they have that many, else `tp` of the same size."""
    return opts.gpus if tp <= target.num_gpus else f"{tp}x{target.gpu_bytes // (1 << 20)}MiB"


def _verify_line(mm, opts, tp: int, gpus: str) -> str:
    """`qtool verify CKPT` at `tp` on `gpus`, keeping every other flag the user gave (the engines, the
    context, the batch, the KV cache dtype, MTP, the utilization): a fix line applied as written checks the
    same serving setup, changed only where the fix says."""
    import shlex

    default = VerifyOptions()
    argv = ["qtool", "verify", str(mm.ckpt.root)]
    if opts.engine != default.engine:
        argv += ["--engine", opts.engine]
    argv += ["--gpus", gpus, "--tp", str(tp)]
    for flag, name in (
        ("--max-model-len", "max_model_len"),
        ("--max-num-seqs", "max_num_seqs"),
        ("--kv-cache-dtype", "kv_cache_dtype"),
        ("--gpu-memory-utilization", "gpu_memory_utilization"),
        ("--mtp", "mtp"),
    ):
        if getattr(opts, name) != getattr(default, name):
            argv += [flag, str(getattr(opts, name))]
    return shlex.join(argv)
