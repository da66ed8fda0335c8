"""ModelOpt MIXED_PRECISION checkpoints (e.g. nvidia/Qwen3.5-397B-A17B-NVFP4-V2: FP8 per-tensor linears and
NVFP4 routed experts): each module's algorithm comes from the per-module `quantized_layers` mapping, not
from one global algorithm, so the global ignore-list check does not apply.

vLLM 0.33.0 (vllm/model_executor/layers/quantization/modelopt.py, ModelOptMixedPrecisionConfig; vllm PR
35047): a module in `exclude_modules` is unquantized; otherwise `_resolve_quant_algo(prefix)` looks the
module up in `quantized_layers` (the exact name, `model.language_model.` <-> `language_model.model.`, a
packed module through its shards, a routed-experts prefix through any key below it); a module it does
not find is built unquantized. NVFP4 / W4A16_NVFP4 entries take NVFP4 tensors, FP8 entries FP8 ones.
SGLang's handling of this schema is not modelled (a warning).
"""

from __future__ import annotations

from qtool.arch.model_map import QUANTIZED_FORMATS, Format, ModelMap
from qtool.engines import Engine, EngineVersion
from qtool.engines.decide import decide, flavour_of, unit_formats
from qtool.findings import Code, Finding, error, warning
from qtool.io.quant_config import QuantSummary

MIXED = "MIXED_PRECISION"
# quant_algo of a quantized_layers entry -> the storage format its tensors must have
ALGO_FORMAT = {"NVFP4": Format.NVFP4, "W4A16_NVFP4": Format.NVFP4, "FP8": Format.FP8}


def is_mixed(summary: QuantSummary) -> bool:
    return MIXED in {str(summary.quant_algo or "").upper(), str(summary.hf_quant_algo or "").upper()}


def quantized_layers(config: dict | None, hq: dict | None) -> dict[str, dict]:
    """The mapping vLLM reads: config.json's quantization_config first, else hf_quant_config.json."""
    qc = (config or {}).get("quantization_config") or {}
    found = qc.get("quantized_layers")
    if not found and hq:
        body = hq.get("quantization", hq)
        found = body.get("quantized_layers")
    return found if isinstance(found, dict) else {}


# vLLM's packed modules and their checkpoint shards (packed_modules_mapping of models/qwen3_5.py)
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}


def _candidates(name: str) -> list[str]:
    out = [name]
    for a, b in (
        ("model.language_model.", "language_model.model."),
        ("language_model.model.", "model.language_model."),
    ):
        if name.startswith(a):
            out.append(b + name[len(a) :])
    return out


def resolve_algo(unit: str, rep: str, layers: dict[str, dict]) -> str | None:
    """The quant_algo vLLM resolves for an engine unit (represented by HF module `rep`), or None."""
    for name in (unit, rep):
        for c in _candidates(name):
            if c in layers:
                return str(layers[c].get("quant_algo", "")).upper()
    head, _, proj = unit.rpartition(".")
    shards = PACKED.get(proj)
    if shards:  # a packed module: the one algorithm its listed shards agree on (vLLM raises if they differ)
        algos = {
            str(layers[c + "." + sh].get("quant_algo", "")).upper()
            for c in _candidates(head)
            for sh in shards
            if c + "." + sh in layers
        }
        if len(algos) == 1:
            return algos.pop()
        if len(algos) > 1:
            return "MIXED:" + "/".join(sorted(algos))
    for c in _candidates(unit):  # routed experts (and parents): any entry below the prefix
        for key, info in layers.items():
            if key.startswith(c + "."):
                return str(info.get("quant_algo", "")).upper()
    return None


def mixed_findings(
    mm: ModelMap, summary: QuantSummary, versions: list[EngineVersion]
) -> tuple[list[Finding], dict[str, dict], dict[str, dict[str, bool | None]]]:
    """(findings, per-engine summary, {engine: {unit: excluded}}) as engine_rules.decision_findings."""
    ckpt = mm.ckpt
    layers = quantized_layers(ckpt.config, ckpt.hf_quant_config)
    findings: list[Finding] = []
    summaries: dict[str, dict] = {}
    decisions: dict[str, dict[str, bool | None]] = {}
    if not layers:
        findings.append(
            error(
                Code.BAD_CONFIG,
                None,
                "quant_algo MIXED_PRECISION without a `quantized_layers` "
                "mapping: vLLM refuses it (\"requires a non-empty 'quantized_layers' mapping\")",
                "restore hf_quant_config.json / config.json from the source repository",
            )
        )
        return findings, {str(v): {"quant_algo": MIXED, "modelled": False} for v in versions}, decisions
    ignore = summary.effective_ignore or []
    for v in versions:
        eng = str(v)
        if v.engine is not Engine.VLLM:
            findings.append(
                warning(
                    Code.ENGINE_RULES_NOT_MODELLED,
                    None,
                    f"{eng}: qtool does not model SGLang's MIXED_PRECISION loading; which modules "
                    "load quantized was not checked for it",
                    None,
                    eng,
                )
            )
            summaries[eng] = {"quant_algo": MIXED, "modelled": False}
            continue
        counts = {"units": 0, "quantized": 0, "excluded": 0, "refused": 0, "errors": 0, "warnings": 0}
        reps = unit_formats(mm)
        decisions[eng] = {}
        for unit, (excluded, fmt) in sorted(decide(mm, ignore, flavour_of(summary), v).items()):
            counts["units"] += 1
            algo = None if excluded else resolve_algo(unit, reps[unit][0], layers)
            decisions[eng][unit] = algo is None
            want = ALGO_FORMAT.get(algo) if algo else Format.BF16
            counts["quantized" if algo else "excluded"] += 1
            if algo and algo.startswith("MIXED:"):
                findings.append(
                    error(
                        Code.PARTIAL_FUSED_EXCLUSION,
                        unit,
                        f"quantized_layers gives the shards of "
                        f'{unit} different algorithms ({algo[6:]}): {eng} refuses it ("Mixed quant_algo '
                        'within fused layer")',
                        "list every shard of the fused module with one algorithm",
                        eng,
                    )
                )
                counts["errors"] += 1
                continue
            if algo and want is None:
                findings.append(
                    warning(
                        Code.ENGINE_RULES_NOT_MODELLED,
                        unit,
                        f"{unit}: quant_algo {algo} in quantized_layers is not modelled",
                        None,
                        eng,
                    )
                )
                continue
            if fmt == want:
                continue
            if fmt == "mixed":
                code, what = (
                    Code.BF16_BUT_NOT_IGNORED,
                    f"the shards of {unit} mix BF16 and quantized tensors; "
                    f"{eng} loads the fused module in one format ({algo or 'BF16'})",
                )
            elif fmt in QUANTIZED_FORMATS and want is Format.BF16:
                code, what = (
                    Code.QUANTIZED_BUT_IGNORED,
                    f"{unit} is {fmt.value} in the tensors but not in "
                    f"quantized_layers: {eng} builds it unquantized (weight size mismatch at load)",
                )
            elif fmt is Format.BF16:
                code, what = (
                    Code.BF16_BUT_NOT_IGNORED,
                    f"{unit} is BF16 in the tensors but quantized_layers "
                    f"says {algo}: {eng} builds it quantized (shape mismatch at load)",
                )
            else:
                code, what = (
                    Code.DTYPE_MISMATCH,
                    f"{unit} is {getattr(fmt, 'value', fmt)} in the tensors but "
                    f"quantized_layers says {algo}: {eng} builds it as {algo}",
                )
            findings.append(
                error(
                    code,
                    unit,
                    what,
                    "make quantized_layers list every quantized module with the "
                    "algorithm its tensors have (and no other)",
                    eng,
                )
            )
            counts["errors"] += 1
        summaries[eng] = {"flavour": "modelopt", "quant_algo": MIXED, **counts}
    return findings, summaries, decisions
