"""Engine semantics and serving constraints, module by module.

What each engine decides (quantized or BF16) comes from qtool.engines (vLLM: exact / substring / fnmatch
/ HF->vLLM mapper / fused-shard all-or-nothing / router and mtp.fc by version, see engines/vllm.py with
its upstream citations; SGLang: glob->regex full match on prefix and dotted parts, `model.layers.*` vs
`model.language_model.layers.*` by version, see engines/sglang.py). This module checks each decision
against the storage format the tensors really have, and the TP / MTP / KV constraints of serving.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

from qtool.arch.model_map import QUANTIZED_FORMATS, Format, ModelMap
from qtool.arch.qwen35 import Group
from qtool.engines import Engine, EngineVersion, mixed_precision, unit_of
from qtool.engines.decide import decide, engine_rules_modelled, flavour_of, rules_not_modelled, unit_formats
from qtool.findings import Code, Finding, error, patch_cmd, warning
from qtool.io.quant_config import QuantSummary
from qtool.ops.checks import FIX

# NVFP4 GEMMs need the per-GPU input features to be a multiple of the 16-element block:
# vllm/model_executor/layers/quantization/modelopt.py ModelOptNvFp4LinearMethod.create_weights raises
# "Unsupported model when in features size is not multiple of 16" (docs/formats.md §6).
NVFP4_BLOCK = 16
# Row-parallel Linears split their INPUT features across TP ranks (RowParallelLinear in vLLM/SGLang
# models/qwen3_5.py, qwen3_next.py, qwen3_vl.py); column-parallel ones split outputs.
ROW_PARALLEL_LEAVES = frozenset({"o_proj", "down_proj", "out_proj", "linear_fc2", "proj"})
# 2-D weights that are not Linears: the vision tower's learned position table is an nn.Embedding
# (vLLM models/qwen3_vl.py Qwen3_VisionTransformer.pos_embed), never quantized by either engine.
NOT_LINEAR_SUFFIXES = (".pos_embed",)


def _fix_for(unit: str, kind: str, ckpt: str) -> str:
    if kind in ("router", "shared_expert_gate"):
        return patch_cmd(ckpt, "--fix", "router-ignore")
    if unit.startswith("mtp."):
        return patch_cmd(ckpt, "--fix", "mtp-ignore")
    return patch_cmd(ckpt, "--fix", "ignore-from-tensors")


def decision_findings(
    mm: ModelMap, summary: QuantSummary, versions: list[EngineVersion], *, mtp_requested: bool
) -> tuple[list[Finding], dict[str, dict], dict[str, dict[str, bool | None]]]:
    """(findings, per-engine summary, {engine: {unit: excluded}}) for a quantized checkpoint."""
    ckpt = str(mm.ckpt.root)
    findings: list[Finding] = []
    summaries: dict[str, dict] = {}
    decisions_by_engine: dict[str, dict[str, bool | None]] = {}
    if not summary.quantized:
        for v in versions:
            summaries[str(v)] = {"quantized_checkpoint": False}
        return findings, summaries, decisions_by_engine

    if mixed_precision.is_mixed(summary):  # per-module algorithms: its own rule (engines/mixed_precision.py)
        return mixed_precision.mixed_findings(mm, summary, versions)
    if not engine_rules_modelled(summary):
        findings.append(rules_not_modelled(summary))
        for v in versions:
            summaries[str(v)] = {"quant_method": summary.quant_method, "modelled": False}
        return findings, summaries, decisions_by_engine
    ignore = summary.effective_ignore or []
    fl = flavour_of(summary)
    for v in versions:
        eng = str(v)
        dec = {u: d for u, d in decide(mm, ignore, fl, v).items() if not u.endswith(NOT_LINEAR_SUFFIXES)}
        if not summary.weights_quantized:
            # a KV-cache-only compressed-tensors config (`config_groups: {}`, what calibrate-kv writes on a
            # BF16 model): no scheme targets any Linear, so both engines build every one unquantized
            # whatever `ignore` says (vLLM compressed_tensors.py get_scheme -> None ->
            # UnquantizedLinearMethod; SGLang compressed_tensors.py likewise) and load only the KV scales
            dec = {u: (True, fmt) for u, (_ex, fmt) in dec.items()}
        decisions_by_engine[eng] = {u: ex for u, (ex, _f) in dec.items()}
        counts = {"units": len(dec), "quantized": 0, "excluded": 0, "refused": 0, "errors": 0, "warnings": 0}
        for unit, (excluded, fmt) in sorted(dec.items()):
            kind = unit_of(unit).kind if not unit.endswith(".mlp.experts") else "moe"
            is_mtp = unit.startswith("mtp.")
            sev_error = mtp_requested or not is_mtp  # the drafter is not built without --mtp
            mk = error if sev_error else warning
            if excluded is None:
                counts["refused"] += 1
                f = mk(
                    Code.PARTIAL_FUSED_EXCLUSION,
                    unit,
                    f"{eng} refuses the ignore list: it excludes some but not all shards of {unit} "
                    '("Detected some but not all shards ... are quantized")',
                    _fix_for(unit, kind, ckpt),
                    eng,
                )
            elif fmt == "mixed":
                f = mk(
                    Code.BF16_BUT_NOT_IGNORED if not excluded else Code.QUANTIZED_BUT_IGNORED,
                    unit,
                    f"the shards of {unit} mix BF16 and quantized tensors; {eng} loads the fused module in one format",
                    "requantize or restore all shards of the fused module alike",
                    eng,
                )
            elif excluded:
                counts["excluded"] += 1
                if fmt in QUANTIZED_FORMATS:
                    f = mk(
                        Code.QUANTIZED_BUT_IGNORED,
                        unit,
                        f"{unit} is {fmt.value} in the tensors but {eng} loads it as BF16 (excluded by the "
                        "config): weight/scale size mismatch at load",
                        _fix_for(unit, "linear", ckpt),
                        eng,
                    )
                else:
                    continue
            else:
                counts["quantized"] += 1
                if fmt is Format.BF16:
                    code = Code.MTP_NOT_EXCLUDED if is_mtp else Code.BF16_BUT_NOT_IGNORED
                    f = mk(
                        code,
                        unit,
                        f"{unit} is BF16 in the tensors but {eng} builds it quantized (not excluded by the "
                        "config): shape mismatch at load",
                        _fix_for(unit, kind, ckpt),
                        eng,
                    )
                else:
                    continue
            counts["errors" if f.is_error else "warnings"] += 1
            findings.append(f)
        summaries[eng] = {"flavour": fl.value, **counts}
    return findings, summaries, decisions_by_engine


def _in_features(mm: ModelMap, module: str) -> int | None:
    m = mm.modules.get(module)
    if m is None:
        return None
    p = m.params
    for key, factor in (("weight_packed", 2), ("weight", 1), ("qweight", None)):
        t = p.get(key)
        if t is None or len(t.shape) != 2:
            continue
        if key == "qweight":
            return t.shape[0]  # AutoAWQ qweight is [in, out/8]
        if m.format in (Format.NVFP4, Format.NVFP4_CT):
            return t.shape[1] * 2
        return t.shape[1] * (factor or 1)
    dn = p.get("down_proj")
    if dn is not None and len(dn.shape) == 3:  # fused experts: down_proj [E, H, I]
        return dn.shape[2]
    return None


_PER_EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def sglang_dropped_experts(mm: ModelMap) -> tuple[str | None, list[str]]:
    """The per-expert tensors SGLang 0.5.23's target model never loads, and the fused key that caused it.

    Its loader (models/qwen3_5.py Qwen3_5MoeForConditionalGeneration.load_weights) switches a sticky
    `is_fused_expert` flag at the first `*.experts.gate_up_proj` / `*.experts.down_proj` it meets and maps
    every later expert tensor by the fused names only, so a per-expert tensor after that point matches
    nothing and is skipped with a warning. Its order: shard files sorted by name, keys sorted within a shard
    (safetensors' `keys()`); names containing "mtp" are the drafter's (whose loader decides per tensor).
    A fused layer that sorts after every per-expert one therefore loads; one before them empties them."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in mm.ckpt.tensors:
        if "mtp" not in name:
            by_file[mm.ckpt.shard_of(name)].append(name)
    first_fused, dropped = None, []
    for shard in sorted(by_file):
        for name in sorted(by_file[shard]):
            if first_fused is None and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                first_fused = name
            elif first_fused is not None and _PER_EXPERT_KEY.search(name):
                dropped.append(name)
    return first_fused, dropped


def per_engine_layout(findings: list[Finding], versions: list[EngineVersion], mm: ModelMap) -> list[Finding]:
    """`mixed-expert-layout` for the engine whose loader loses tensors over it. vLLM 0.33 maps each expert
    tensor by its own layout (a fused layer among per-expert ones, a fused MTP with a per-expert decoder, the
    transformers fused export: all load bit-identical; tests/engines/test_loaders.py), so no finding for it.
    SGLang 0.5.23 drops the per-expert tensors that come after the first fused one in its load order
    (sglang_dropped_experts): an error naming how many and which layers, or nothing when none are lost."""
    if not any(f.code is Code.MIXED_EXPERT_LAYOUT and f.engine is None for f in findings):
        return findings
    out = [f for f in findings if not (f.code is Code.MIXED_EXPERT_LAYOUT and f.engine is None)]
    first_fused, dropped = sglang_dropped_experts(mm)
    if not dropped:
        return out
    layers = sorted({int(m.group(1)) for n in dropped if (m := _LAYER.search(n))})
    module = first_fused.rsplit(".", 1)[0] if first_fused else None
    fix = FIX[Code.MIXED_EXPERT_LAYOUT]
    for v in versions:
        if v.engine is Engine.SGLANG:
            out.append(
                error(
                    Code.MIXED_EXPERT_LAYOUT,
                    module,
                    f"{v} drops {len(dropped)} per-expert tensors (layers {_ranges(layers)}) that come after "
                    f"the first fused expert tensor {first_fused} in its load order (shards by name, keys "
                    "sorted): its Qwen3.5 loader maps every later expert tensor by the fused names "
                    "(sglang models/qwen3_5.py load_weights, is_fused_expert)",
                    fix,
                    engine=str(v),
                )
            )
    return out


def _ranges(xs: list[int]) -> str:
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _expert_scheme(m) -> tuple[str, int | None]:
    """(storage format, INT4 group size or None) of one routed-expert projection, from its tensors."""
    p = m.params
    if m.format is Format.INT4_CT and "weight_scale" in p and "weight_packed" in p:
        n_in = p["weight_packed"].shape[-1] * 8  # int32 words of 8 nibbles
        return m.format.value, n_in // max(1, p["weight_scale"].shape[-1])
    if m.format is Format.AWQ and "scales" in p and "qweight" in p:
        return m.format.value, p["qweight"].shape[0] // max(1, p["scales"].shape[0])  # [in, out/8], [in/g, out]
    return (m.format.value if m.format else "none"), None


def moe_scheme_findings(mm: ModelMap, versions: list[EngineVersion]) -> list[Finding]:
    """Every projection of a layer's experts in one scheme: vLLM 0.33 and SGLang 0.5.23 build one fused MoE
    method per layer and refuse at model build with "All MoE projections need to have same quantization
    scheme but found multiple" (compressed_tensors_moe.py CompressedTensorsMoEMethod.get_moe_method) when
    gate/up and down differ (e.g. INT4 group 64 for gate/up and 32 for down)."""
    schemes: dict[str, set] = {}
    for m in mm.modules.values():
        if m.inner is Group.ROUTED_EXPERTS and m.expert is not None and m.format in QUANTIZED_FORMATS:
            unit = m.name.partition(".mlp.experts.")[0] + ".mlp.experts"
            schemes.setdefault(unit, set()).add(_expert_scheme(m))
    out: list[Finding] = []
    for unit, found in sorted(schemes.items()):
        if len(found) < 2:
            continue
        what = ", ".join(f"{fmt}" + (f" group {g}" if g else "") for fmt, g in sorted(found, key=str))
        for v in versions:
            out.append(
                error(
                    Code.MOE_SCHEME_MISMATCH,
                    unit,
                    f"the expert projections of {unit} use several schemes ({what}); {v} refuses at model "
                    'build: "All MoE projections need to have same quantization scheme but found multiple"',
                    "requantize the experts with one scheme for gate/up and down (qtool quantize picks "
                    "one INT4 group size for all projections)",
                    str(v),
                )
            )
    return out


def _weight_only(config: dict | None) -> bool:
    """True when the config's schemes quantize no activations (`input_activations: null` in every config
    group: ModelOpt / compressed-tensors NVFP4A16)."""
    qc = (config or {}).get("quantization_config") or {}
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    return all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())


_INPUT_SCALE = {Format.NVFP4: "input_scale", Format.NVFP4_CT: "input_global_scale"}


def input_scale_findings(mm: ModelMap) -> list[Finding]:
    """NVFP4 modules without their activation scale, one finding per layer's experts or per module.

    W4A4 (the config quantizes activations): the engines create the scale parameter and nothing fills it
    (vLLM modelopt.py ModelOptNvFp4LinearMethod / FusedMoE create `input_scale`; compressed-tensors
    `input_global_scale`): the module computes with an uninitialised scale, an error. Weight-only configs
    (`input_activations: null`): vLLM folded an uninitialised input_scale of 0.0 into the experts, so
    every expert output was zero (vllm issue 54189, fixed by PR 54427): a warning naming the fix."""
    weight_only = _weight_only(mm.ckpt.config)
    missing: dict[str, list[str]] = {}
    for m in mm.modules.values():
        key = _INPUT_SCALE.get(m.format)
        if key is None or key in m.param_names:
            continue
        unit = m.name.partition(".mlp.experts.")[0] + ".mlp.experts" if m.expert is not None else m.name
        missing.setdefault(unit, []).append(m.name)
    out: list[Finding] = []
    for unit, mods in sorted(missing.items()):
        what = f"{len(mods)} NVFP4 module(s) of {unit} lack {_INPUT_SCALE.get(mm.modules[mods[0]].format)}"
        if weight_only:
            out.append(
                warning(
                    Code.INPUT_SCALE_MISSING,
                    unit,
                    f"{what} (a weight-only config): vLLM builds before PR 54427 fold an uninitialised "
                    "input_scale of 0.0 into them and every expert outputs zero (vllm issue 54189)",
                    "serve with a vLLM that has PR 54427, or write input scales (qtool quantize calibrates them)",
                )
            )
        else:
            out.append(
                error(
                    Code.INPUT_SCALE_MISSING,
                    unit,
                    f"{what}, and the config quantizes activations (W4A4): the engines create the scale "
                    "and nothing fills it",
                    "requantize with calibration (qtool quantize writes calibrated "
                    "input scales), or restore the missing tensors",
                )
            )
    return out


def per_engine_stale_scales(findings: list[Finding], versions: list[EngineVersion], mm: ModelMap) -> list[Finding]:
    """`stale-tensor` for scales on a module stored in BF16, as each engine treats them. The engines build
    the module unquantized, with no parameter for the scale: vLLM 0.33 refuses at load ("There is no module
    or parameter named 'lm_head.input_scale'", vllm issue 45102; an AttributeError for in_proj_a/b, which it
    stacks), an error; SGLang 0.5.23 skips it with "Parameter ... not found in params_dict", a warning;
    older SGLang (sglang issue 19587, reported on main of 2026-02-28) then failed a shape assertion: an error. Both
    checked with the real loaders
    (tests/engines/test_loaders.py variant-stray-*). Other stale tensors keep their engine-free error."""

    def on_bf16_module(f: Finding) -> bool:
        m = mm.modules.get(f.module or "")
        return f.code is Code.STALE_TENSOR and f.engine is None and m is not None and m.format is Format.BF16

    stale = [f for f in findings if on_bf16_module(f)]
    if not stale:
        return findings
    out = [f for f in findings if not on_bf16_module(f)]
    for f in stale:
        for v in versions:
            if v.engine is Engine.VLLM:
                out.append(
                    error(
                        f.code,
                        f.module,
                        f"{f.message}: {v} has no parameter for them and refuses at load (vllm issue 45102)",
                        f.fix,
                        engine=str(v),
                    )
                )
            elif v.at_least((0, 5, 23)):
                out.append(
                    warning(
                        f.code,
                        f.module,
                        f"{f.message}: {v} skips them with a warning (the load failure "
                        "of sglang issue 19587 is a skip since)",
                        f.fix,
                        engine=str(v),
                    )
                )
            else:  # the SGLang of sglang issue 19587 (main of 2026-02-28) failed the load on them
                out.append(
                    error(
                        f.code,
                        f.module,
                        f'{f.message}: {v} fails the load on them ("Parameter ... not '
                        'found in params_dict", then a shape assertion: sglang issue 19587)',
                        f.fix,
                        engine=str(v),
                    )
                )
    return out


def _sglang_reads_kv_scheme(scheme: dict | None) -> bool:
    """SGLang 0.5.23 builds a KV-cache method only for static symmetric per-tensor FP8 (compressed_tensors.py
    CompressedTensorsKVCacheMethod.is_supported_scheme); any other kv_cache_scheme is ignored with a warning."""
    if not scheme:
        return True  # ModelOpt / no compressed-tensors scheme: its per-tensor method
    return (
        scheme.get("type") == "float"
        and scheme.get("num_bits") == 8
        and scheme.get("strategy") == "tensor"
        and scheme.get("symmetric", True)
        and not scheme.get("dynamic", False)
    )


def kv_ignored_findings(
    mm: ModelMap, summary: QuantSummary, versions: list[EngineVersion], kv_cache_dtype: str
) -> list[Finding]:
    """KV scales an engine skips, so its FP8 KV cache runs with scale 1.0 (an error with --kv-cache-dtype fp8,
    else a warning: the scales are unused then). vLLM 0.33 loads every form below. SGLang 0.5.23 skips:
    - the `self_attn.qkv_proj.{k,v}_scale` spelling (older llm-compressor): its QWEN3_5_KV_SCALE_MAPPER
      (models/qwen3_5.py) maps `self_attn.k_proj.k_scale` (ModelOpt), `self_attn.k_scale` (compressed-
      tensors) and `self_attn.attn.k_scale` only, and drops the rest as ignorable suffixes (sglang 39942);
    - per-head scales and any kv_cache_scheme but static symmetric per-tensor FP8 (`strategy: attn_head`,
      vllm PR 30141): it builds no KV-cache method for them.
    Checked with both real loaders (tests/engines/test_loaders.py variant-kv-*)."""
    kv_names = mm.kv_scale_tensors()
    if not kv_names:
        return []
    reasons = []
    qkv = [n for n in kv_names if mm.roles[n].module.endswith(".qkv_proj")]
    if qkv:
        reasons.append(
            f"{len(qkv)} are spelled self_attn.qkv_proj.{{k,v}}_scale, which its Qwen3.5 KV-scale "
            "mapper does not map (sglang issue 39942)"
        )
    scheme = summary.kv_cache_scheme if summary.quant_method == "compressed-tensors" else None
    if mm.kv.per_head or not _sglang_reads_kv_scheme(scheme):
        form = ", ".join(f"{k}={(scheme or {}).get(k)!r}" for k in ("strategy", "num_bits", "dynamic"))
        reasons.append(
            f"{'per-head scales, ' if mm.kv.per_head else ''}kv_cache_scheme {form} is not static "
            "per-tensor FP8, the only KV scheme it builds (compressed_tensors.py is_supported_scheme)"
        )
    if not reasons:
        return []
    fp8 = kv_cache_dtype == "fp8"
    make = error if fp8 else warning
    naming = "self_attn.k_proj.k_scale" if mm.kv.naming == "modelopt" else "self_attn.k_scale"
    fix = (
        f"qtool calibrate-kv {mm.ckpt.root} -o OUT --replace-scales (per-tensor FP8 scales named {naming}, "
        "which both engines load)"
    )
    return [
        make(
            Code.KV_SCALES_IGNORED,
            kv_names[0],
            f"{v} skips the checkpoint's {len(kv_names)} KV scales, so its "
            f"{'FP8 ' if fp8 else ''}KV cache would use scale 1.0: " + "; ".join(reasons),
            fix,
            engine=str(v),
        )
        for v in versions
        if v.engine is Engine.SGLANG
    ]


def attention_gate_findings(mm: ModelMap) -> list[Finding]:
    """Qwen3.5's full-attention q_proj holds the query AND the attention output gate (attn_output_gate:
    the gate half of the fused q_proj). NVFP4 there was reported to degrade hybrid Qwen3.5/3.6 exports
    2-6x in perplexity (NVIDIA ModelOpt issue 2091); later measurements upstream dispute the cause, so a
    warning with the source, not an error."""
    if not mm.ckpt.text_config.get("attn_output_gate", True):
        return []
    layers = sorted(
        {
            m.layer
            for m in mm.modules.values()
            if m.name.endswith(".self_attn.q_proj")
            and m.format in (Format.NVFP4, Format.NVFP4_CT)
            and m.layer is not None
        }
    )
    if not layers:
        return []
    return [
        warning(
            Code.ATTENTION_GATE_QUANTIZED,
            None,
            f"q_proj of full-attention layers {layers} is NVFP4; it carries the attention output gate, and "
            "NVFP4 there was reported to degrade Qwen3.5 perplexity 2-6x (NVIDIA ModelOpt issue 2091; "
            "disputed upstream)",
            "keep self_attn.q_proj in BF16 (add it to the ignore list before "
            "quantizing), or measure with qtool eval kld",
        )
    ]


TP_SIZES = (1, 2, 4, 8)  # the tensor-parallel sizes people serve at (one box's GPUs)


def tp_findings(
    mm: ModelMap, tp: int, decisions: dict[str, dict[str, bool | None]], serve_at: Callable[[list[int]], str]
) -> list[Finding]:
    """Head counts and expert sizes divisible by TP, and NVFP4 per-GPU input features a multiple of 16 for
    every module an engine builds quantized. Each fix names what works for this checkpoint: the patch that
    makes a config agree with its tensors, or `serve_at(the TP sizes it shards at, never the one that
    failed)`: the caller's, which knows the GPUs and the user's flags (qtool.ops.verify._tp_fix)."""
    found = _tp_problems(mm, tp, decisions)
    if not found:
        return []
    serve = serve_at([t for t in TP_SIZES if t != tp and not _tp_problems(mm, t, decisions)])
    ckpt = str(mm.ckpt.root)
    out = []
    for module, message, engine, config_only in found:
        if config_only:  # BF16 tensors the config calls quantized: make the config agree
            fix = patch_cmd(ckpt, "--fix", "ignore-from-tensors")
        elif module.startswith("model.visual."):
            fix = (
                "exclude it from quantization and serve the vision tower data-parallel: "
                + patch_cmd(ckpt, "--ignore-add", "model.visual*")
                + " ; then --mm-encoder-tp-mode data"
            )
        else:
            fix = serve
        out.append(error(Code.TP_DIVISIBILITY, module, message, fix, engine))
    return out


def _tp_problems(
    mm: ModelMap, tp: int, decisions: dict[str, dict[str, bool | None]]
) -> list[tuple[str, str, str | None, bool]]:
    """(module or config key, message, engine, whether the config alone is wrong) for each way the
    checkpoint does not shard at `tp`."""
    cfg = mm.ckpt.text_config
    out: list[tuple[str, str, str | None, bool]] = []
    for key, what in (
        ("num_attention_heads", "attention heads"),
        ("linear_num_key_heads", "GDN key heads"),
        ("linear_num_value_heads", "GDN value heads"),
    ):
        n = cfg.get(key)
        if isinstance(n, int) and n % tp:
            out.append((key, f"{key}={n}: {n} {what} do not split over TP={tp}", None, False))
    nkv = cfg.get("num_key_value_heads")
    # KV heads are split when nkv >= tp and replicated when tp is a multiple of nkv (vLLM QKVParallelLinear)
    if isinstance(nkv, int) and nkv % tp and tp % nkv:
        out.append(
            ("num_key_value_heads", f"num_key_value_heads={nkv} neither divides nor is divided by TP={tp}", None, False)
        )
    for key, what in (
        ("moe_intermediate_size", "each routed expert's intermediate size"),
        ("shared_expert_intermediate_size", "the shared expert's intermediate size"),
    ):
        n = cfg.get(key)
        if isinstance(n, int) and n % tp:
            out.append((key, f"{key}={n} ({what}) does not split over TP={tp}", None, False))
    reps = unit_formats(mm)
    seen: set[tuple[str, str]] = set()  # (engine, unit): each engine that builds it gets its finding
    for eng, dec in decisions.items():
        for unit, excluded in dec.items():
            if excluded is not False or (eng, unit) in seen:
                continue
            rep, fmt = reps[unit]
            if fmt not in (Format.NVFP4, Format.NVFP4_CT, Format.BF16):
                continue
            if unit.endswith(".mlp.experts"):
                # FusedMoE: w13 [E, 2I, H] is column-parallel, w2 [E, H, I] row-parallel over I
                down = rep.rsplit(".", 1)[0] + ".down_proj" if rep.endswith(("gate_proj", "up_proj")) else rep
                inn = _in_features(mm, down) if down in mm.modules else cfg.get("moe_intermediate_size")
                row = True
            else:
                inn = _in_features(mm, rep)
                row = rep.rsplit(".", 1)[-1] in ROW_PARALLEL_LEAVES
            if inn is None:
                continue
            per_gpu = inn // tp if row else inn
            if (row and inn % tp) or per_gpu % NVFP4_BLOCK:
                seen.add((eng, unit))
                out.append(
                    (
                        unit,
                        f"{eng} builds {unit} as NVFP4 with {inn} input features, {per_gpu} per GPU at "
                        f'TP={tp}: not a multiple of {NVFP4_BLOCK} ("Unsupported model when in features '
                        'size is not multiple of 16")',
                        eng,
                        fmt is Format.BF16,
                    )
                )
    return out


# vllm#34948: speculative decoding over the GDN layers hits an illegal memory access under load beyond this
MTP_STABLE_MAX = 3


def mtp_findings(mm: ModelMap, mtp: int) -> list[Finding]:
    if mtp <= 0:
        return []
    if not mm.modules_in(Group.MTP):
        return [
            error(
                Code.MTP_MISSING,
                "mtp",
                f"--mtp {mtp} asked for, but the checkpoint has no mtp.* head "
                "(speculative decoding would run with 0% acceptance)",
                "graft it from the BF16 original: qtool assemble hybrid --nvfp4 CKPT --bf16 BF16 -o OUT "
                "--mtp from-bf16; or serve without --mtp",
            )
        ]
    if mtp > MTP_STABLE_MAX:
        return [
            warning(
                Code.MTP_UNSTABLE,
                "mtp",
                f"--mtp {mtp}: more than {MTP_STABLE_MAX} speculative tokens "
                "are unstable under load with the GDN attention backend (vllm#34948: a CUDA illegal memory access)",
                f"--mtp {MTP_STABLE_MAX} at most",
            )
        ]
    return []


def kv_findings(mm: ModelMap, kv_cache_dtype: str) -> list[Finding]:
    """With --kv-cache-dtype fp8 every full-attention layer needs real (calibrated) k/v scales; without
    them vLLM and SGLang fall back to scale 1.0 (docs/formats.md §6, §12)."""
    if kv_cache_dtype != "fp8":
        return []
    ckpt = str(mm.ckpt.root)
    kv = mm.kv
    # scales already there (some layers', or uncalibrated ones) are replaced only when asked
    fix = f"qtool calibrate-kv {ckpt} --in-place" + (" --replace-scales" if kv.layers else "")
    missing = [layer for layer in mm.full_attention if layer not in kv.layers]
    out: list[Finding] = []
    if missing:
        out.append(
            error(
                Code.KV_SCALES_MISSING,
                f"layers {missing[:8]}",
                f"--kv-cache-dtype fp8 but {len(missing)} of {len(mm.full_attention)} full-attention "
                "layers have no k/v scales (the engine would use 1.0)",
                fix,
            )
        )
    if kv.invalid:
        out.append(
            error(
                Code.KV_SCALES_UNCALIBRATED,
                kv.invalid[0],
                f"{len(kv.invalid)} k/v scale(s) are not finite positive numbers",
                fix,
            )
        )
    elif kv.layers and kv.calibrated is False:
        out.append(
            error(
                Code.KV_SCALES_UNCALIBRATED,
                None,
                "every k/v scale is the constant 1.0 (an fp8_cast export, not calibrated)",
                fix,
            )
        )
    return out
