"""Structure findings: headers, index, configs, and every tensor the architecture needs.

The tensor-level checks are qtool.ops.checks.check_structure (post-assembly checks) and
qtool.ops.inspect.find_problems; this module calls them and turns their problems into findings with
stable codes. Headers are diagnosed shard by shard only when `Checkpoint.open` refuses the directory,
so a healthy checkpoint's headers are parsed once.
"""

from __future__ import annotations

import re
from pathlib import Path

from qtool.arch.model_map import ModelMap
from qtool.errors import CheckpointError, ConfigError, HeaderError
from qtool.io.checkpoint import INDEX_NAME, Checkpoint
from qtool.io.quant_config import QuantSummary
from qtool.ops.verify.findings import Code, Finding, error, patch_cmd, warning

REDOWNLOAD = "re-download or rebuild this shard (its sha256 is in the Hub's file list / qtool-manifest.json)"


def open_checked(path: str | Path) -> tuple[Checkpoint | None, list[Finding]]:
    """Open the checkpoint; when that fails, diagnose every shard's header so all broken shards are
    reported, not only the first."""
    try:
        return Checkpoint.open(path, require_config=True), []
    except ConfigError as e:
        if e.path and Path(e.path).name == INDEX_NAME:
            return None, [error(Code.BAD_INDEX, INDEX_NAME, e.message, "re-download the index")]
        return None, [error(Code.BAD_CONFIG, e.path, e.message, "restore config.json / hf_quant_config.json "
                            "from the source repository")]
    except HeaderError as e:
        found = _diagnose_headers(Path(path))
        return None, found or [_header_finding(e)]
    except CheckpointError as e:
        if e.path and Path(e.path).name == INDEX_NAME or "index" in e.message:
            return None, [error(Code.BAD_INDEX, e.tensor or e.path, e.message, e.hint)]
        if "config.json" in e.message:
            return None, [error(Code.BAD_CONFIG, e.path, e.message, e.hint)]
        return None, [error(Code.BAD_INDEX, e.tensor or e.path, e.message, e.hint)]


def _header_finding(e: HeaderError) -> Finding:
    truncated = "truncated" in e.message or "too short" in e.message
    code = Code.TRUNCATED_SHARD if truncated else Code.BAD_HEADER
    where = Path(e.path).name if e.path else None
    return error(code, where, e.message + (f" ({e.tensor})" if e.tensor else ""), REDOWNLOAD)


def _diagnose_headers(root: Path) -> list[Finding]:
    from qtool.io.jsonio import load_json
    from qtool.io.safetensors_header import read_header

    if (root / INDEX_NAME).exists():
        try:
            index, _ = load_json(root / INDEX_NAME, what="safetensors index")
            files = sorted(set((index.get("weight_map") or {}).values()))
        except CheckpointError:
            files = []
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    out = []
    for rel in files:
        p = root / rel
        if not p.is_file():
            continue
        try:
            read_header(p)
        except HeaderError as e:
            try:  # parses without the size check -> the header is fine, the data is cut short
                read_header(p, check_file_size=False)
                out.append(error(Code.TRUNCATED_SHARD, rel, e.message, REDOWNLOAD))
            except HeaderError:
                out.append(_header_finding(e))
    return out


# ---- check_structure problems -> codes ----------------------------------------------------------
# Message templates of qtool/ops/checks.py (check_structure and helpers).
_IS_GOT = re.compile(r"^(?P<name>\S+) is (?P<dt>[A-Z0-9_]+)\[(?P<shape>[\d, ]*)\], expected (?P<want>.*)$")
_HAS_SHAPE = re.compile(r"^(?P<name>\S+) has shape \[(?P<shape>[\d, ]*)\], expected")
_FUSED_SHAPE = re.compile(r"^(?P<name>\S+experts\.(?:gate_up_proj|down_proj)) is (?P<got>.+), expected")
_RULES: list[tuple[re.Pattern[str], Code]] = [
    (re.compile(r"^missing (?:module|tensor) (?P<name>\S+)"), Code.MISSING_TENSOR),
    (re.compile(r"^(?P<name>\S+) \([\w-]+\) lacks (?P<p>\S+)"), Code.MISSING_TENSOR),
    (re.compile(r"^(?P<name>\S+) has no weight matrix"), Code.MISSING_TENSOR),
    (re.compile(r"^MTP head lacks (?P<name>\S+)"), Code.MISSING_TENSOR),
    (re.compile(r"^(?P<name>\S+) is [\w-]+ but also carries stale"), Code.STALE_TENSOR),
    (re.compile(r"^(?P<name>\S+) carries \[.*\] but no weight"), Code.STALE_TENSOR),
    (re.compile(r"^(?P<name>\S+) belongs to layer"), Code.STALE_TENSOR),
    (re.compile(r"^(?P<name>\S+) is not part of the"), Code.STALE_TENSOR),
    (re.compile(r"^(?P<name>\S+) has experts beyond"), Code.STALE_TENSOR),
    (re.compile(r"^(?P<name>\S+) mixes the fused layout"), Code.MIXED_EXPERT_LAYOUT),
    (re.compile(r"^routed experts mix layouts"), Code.MIXED_EXPERT_LAYOUT),
    (re.compile(r"^config lacks"), Code.BAD_CONFIG),
]
_FIX = {
    Code.MISSING_TENSOR: "the export or download is incomplete: rebuild it (qtool assemble ...) or re-download "
    "the shard that should hold it",
    Code.STALE_TENSOR: "remove the stale tensors (rebuild with qtool assemble, which drops scales of BF16 modules)",
    Code.DTYPE_MISMATCH: "re-export the module; a relabelled dtype means a corrupt or mis-converted shard",
    Code.SHAPE_MISMATCH: "the tensor does not match config.json: wrong model revision or a broken conversion",
    Code.MIXED_EXPERT_LAYOUT: "rebuild with qtool assemble hybrid (it writes per-expert BF16 experts, never fused "
    "next to per-expert)",
    Code.BAD_CONFIG: "restore config.json from the source repository",
}


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def classify_problem(msg: str) -> tuple[Code, str | None]:
    m = _IS_GOT.match(msg)
    if m:
        want = m.group("want")
        wm = re.search(r"\[([\d, ]*)\]", want)
        got_shape = _shape(m.group("shape"))
        if wm is not None:
            same_shape = got_shape == _shape(wm.group(1))
        else:  # "a float32 scalar"
            same_shape = len(got_shape) == 0 or got_shape == (1,)
        return (Code.DTYPE_MISMATCH if same_shape else Code.SHAPE_MISMATCH), m.group("name")
    m = _HAS_SHAPE.match(msg)
    if m:
        return Code.SHAPE_MISMATCH, m.group("name")
    m = _FUSED_SHAPE.match(msg)
    if m:
        return (Code.MISSING_TENSOR if m.group("got") == "None" else Code.SHAPE_MISMATCH), m.group("name")
    for rx, code in _RULES:
        m = rx.match(msg)
        if m:
            return code, m.groupdict().get("name")
    return Code.MISSING_TENSOR if "missing" in msg else Code.STALE_TENSOR, None


def structure_findings(mm: ModelMap) -> list[Finding]:
    from qtool.ops.checks import MAX_PROBLEMS, check_structure

    res = check_structure(mm)
    out: list[Finding] = []
    for msg in res["problems"]:
        if msg.startswith("... (more problems"):
            out.append(warning(Code.MISSING_TENSOR if not out else out[-1].code, None,
                               f"more than {MAX_PROBLEMS} structural problems; only the first are listed"))
            continue
        code, name = classify_problem(msg)
        out.append(error(code, name, msg, _FIX.get(code)))
    return out


# ---- find_problems -> codes ---------------------------------------------------------------------


def consistency_findings(mm: ModelMap, summary: QuantSummary, *, kv_fp8: bool) -> list[Finding]:
    """Problems of qtool.ops.inspect.find_problems that are not engine decisions (those are modelled per
    engine version in engine_rules): expert layout, gate/up scales, KV scales, config files."""
    from qtool.ops import inspect

    ckpt = str(mm.ckpt.root)
    out: list[Finding] = []
    # find_problems minus its _config_vs_tensors part, which decides for the default engines only;
    # engine_rules decides for the engines and versions asked for (and would do the work twice).
    problems = (inspect._layout_problems(mm) + inspect._incomplete_quant_modules(mm)
                + inspect._gate_up_scale_mismatch(mm) + inspect._kv_problems(mm, summary)
                + inspect._config_file_disagreement(summary))
    for p in problems:
        if p.code == "mixed-expert-layout":
            out.append(error(Code.MIXED_EXPERT_LAYOUT, None, p.message, _FIX[Code.MIXED_EXPERT_LAYOUT]))
        elif p.code == "missing-quant-tensor":
            m = re.search(r"e\.g\. (\S+)$", p.message)
            out.append(error(Code.MISSING_TENSOR, m.group(1) if m else None, p.message, _FIX[Code.MISSING_TENSOR]))
        elif p.code == "scale-mismatch":
            m = re.search(r"e\.g\. (\S+?);", p.message)
            out.append(error(Code.SCALE_MISMATCH, m.group(1) if m else None, p.message,
                             "requantize the expert with one global scale for gate_proj and up_proj "
                             "(ModelOpt preprocess_linear_fusion / qtool.formats.nvfp4 shared gate/up scale)"))
        elif p.code == "config-disagreement":
            out.append(warning(Code.CONFIG_DISAGREEMENT, None, p.message,
                               patch_cmd(ckpt, "--fix", "ignore-from-tensors")))
        elif p.code in ("kv-scales-missing", "kv-scale-invalid"):
            # with --kv-cache-dtype fp8 the serving check (engine_rules.kv_findings) reports these as errors
            if not kv_fp8:
                code = Code.KV_SCALES_MISSING if p.code == "kv-scales-missing" else Code.KV_SCALES_UNCALIBRATED
                out.append(warning(code, None, p.message, f"qtool calibrate-kv {ckpt} --in-place"))
        elif p.code == "kv-scales-stale":
            out.append(error(Code.KV_SCALES_STALE, None, p.message, "remove the k/v scales of non-attention layers"))
        elif p.code == "kv-scheme-missing":
            out.append(warning(Code.CONFIG_DISAGREEMENT, None, p.message,
                               "add kv_cache_scheme (FP8) to quantization_config, or drop the scales"))
        # partial-fused-exclusion / bf16-but-not-ignored / quantized-but-ignored: engine_rules, per version
    return out
