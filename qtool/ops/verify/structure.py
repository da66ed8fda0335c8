"""Structure findings: headers, index, configs, and every tensor the architecture needs.

The tensor-level checks are qtool.ops.checks.check_structure (post-assembly checks) and
qtool.ops.inspect.find_problems; this module calls them and turns their problems into findings with
stable codes. Headers are diagnosed shard by shard only when `Checkpoint.open` refuses the directory,
so a healthy checkpoint's headers are parsed once.
"""

from __future__ import annotations

from pathlib import Path

from qtool.arch.model_map import ModelMap, check_config_sizes
from qtool.errors import CheckpointError, ConfigError, HeaderError
from qtool.findings import Code, Finding, error, patch_cmd, warning
from qtool.io.checkpoint import INDEX_NAME, Checkpoint
from qtool.io.jsonio import load_json
from qtool.io.quant_config import QuantSummary
from qtool.io.safetensors_header import read_header
from qtool.ops import inspect
from qtool.ops.checks import FIX, MAX_PROBLEMS, check_structure

REDOWNLOAD = "re-download or rebuild this shard (its sha256 is in the Hub's file list / qtool-manifest.json)"


def open_checked(path: str | Path) -> tuple[Checkpoint | None, list[Finding]]:
    """Open the checkpoint; when that fails, diagnose every shard's header so all broken shards are
    reported, not only the first."""
    try:
        ckpt = Checkpoint.open(path, require_config=True)
        check_config_sizes(ckpt)  # before the map: a layer count the shards lack is a bad config, not 10^8 findings
        return ckpt, []
    except ConfigError as e:
        if e.path and Path(e.path).name == INDEX_NAME:
            return None, [error(Code.BAD_INDEX, INDEX_NAME, e.message, "re-download the index")]
        return None, [
            error(
                Code.BAD_CONFIG,
                e.path,
                e.message,
                "restore config.json / hf_quant_config.json from the source repository",
            )
        ]
    except HeaderError as e:
        found = _diagnose_headers(Path(path))
        return None, found or [_header_finding(e)]
    except CheckpointError as e:
        if not_a_checkpoint(Path(path)):
            raise  # bad input (exit 1, as inspect's), not a checkpoint that fails verification (exit 3)
        if e.path and Path(e.path).name == INDEX_NAME or "index" in e.message:
            return None, [error(Code.BAD_INDEX, e.tensor or e.path, e.message, e.hint)]
        if "config.json" in e.message:
            return None, [error(Code.BAD_CONFIG, e.path, e.message, e.hint)]
        return None, [error(Code.BAD_INDEX, e.tensor or e.path, e.message, e.hint)]


def not_a_checkpoint(root: Path) -> bool:
    """A folder with neither shards nor an index: no checkpoint at all (a parent of checkpoints, say)."""
    return root.is_dir() and not (root / INDEX_NAME).exists() and not any(root.glob("*.safetensors"))


def _header_finding(e: HeaderError) -> Finding:
    truncated = "truncated" in e.message or "too short" in e.message
    code = Code.TRUNCATED_SHARD if truncated else Code.BAD_HEADER
    where = Path(e.path).name if e.path else None
    return error(code, where, e.message + (f" ({e.tensor})" if e.tensor else ""), REDOWNLOAD)


def _diagnose_headers(root: Path) -> list[Finding]:
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


# ---- check_structure's findings and find_problems' findings, with verify's policy -----------------


def structure_findings(mm: ModelMap) -> list[Finding]:
    res = check_structure(mm)
    out = [Finding.from_json(d) for d in res["findings"]]
    if len(res["problems"]) > len(out):
        out.append(
            warning(
                out[-1].code if out else Code.MISSING_TENSOR,
                None,
                f"more than {MAX_PROBLEMS} structural problems; only the first are listed",
            )
        )
    return out


def consistency_findings(mm: ModelMap, summary: QuantSummary, *, kv_fp8: bool) -> list[Finding]:
    """Problems of qtool.ops.inspect.find_problems that are not engine decisions (those are modelled per
    engine version in engine_rules): expert layout, gate/up scales, KV scales, config files."""
    ckpt = str(mm.ckpt.root)
    out: list[Finding] = []
    # find_problems minus its _config_vs_tensors part, which decides for the default engines only;
    # engine_rules decides for the engines and versions asked for (and would do the work twice).
    problems = (
        inspect._layout_problems(mm)
        + inspect._incomplete_quant_modules(mm)
        + inspect._gate_up_scale_mismatch(mm)
        + inspect._kv_problems(mm, summary)
        + inspect._config_file_disagreement(summary)
    )
    for p in problems:
        if p.code is Code.MIXED_EXPERT_LAYOUT:
            out.append(error(Code.MIXED_EXPERT_LAYOUT, p.module, p.message, FIX[Code.MIXED_EXPERT_LAYOUT]))
        elif p.code is Code.MISSING_QUANT_TENSOR:
            out.append(error(Code.MISSING_TENSOR, p.module, p.message, FIX[Code.MISSING_TENSOR]))
        elif p.code is Code.SCALE_MISMATCH:
            # a warning: both engines load it. vLLM fuses gate/up into w13 with one global scale, warns
            # "w1_weight_scale_2 must match w3_weight_scale_2. Accuracy may be affected." and uses the
            # first (vllm/model_executor/layers/quantization/modelopt.py, ModelOptNvFp4FusedMoE
            # process_weights_after_loading); SGLang 0.5.23 loads the pair likewise (#15, item 4)
            out.append(
                warning(
                    Code.SCALE_MISMATCH,
                    p.module,
                    p.message + ' (vLLM warns "Accuracy may be affected" and uses gate_proj\'s scale '
                    "for both; the checkpoint loads in both engines)",
                    "requantize the expert with one global scale for gate_proj and up_proj "
                    "(ModelOpt preprocess_linear_fusion / qtool.formats.nvfp4 shared gate/up scale)",
                )
            )
        elif p.code is Code.CONFIG_DISAGREEMENT:
            out.append(
                warning(Code.CONFIG_DISAGREEMENT, None, p.message, patch_cmd(ckpt, "--fix", "ignore-from-tensors"))
            )
        elif p.code in (Code.KV_SCALES_MISSING, Code.KV_SCALE_INVALID):
            # with --kv-cache-dtype fp8 the serving check (engine_rules.kv_findings) reports these as errors
            if not kv_fp8:
                code = Code.KV_SCALES_MISSING if p.code is Code.KV_SCALES_MISSING else Code.KV_SCALES_UNCALIBRATED
                out.append(warning(code, p.module, p.message, f"qtool calibrate-kv {ckpt} --in-place"))
        elif p.code is Code.KV_SCHEME_MISMATCH:
            out.append(
                warning(Code.KV_SCHEME_MISMATCH, None, p.message, patch_cmd(ckpt, "--fix", "kv-scheme-from-tensors"))
            )
        elif p.code is Code.KV_SCALES_STALE:
            out.append(error(Code.KV_SCALES_STALE, None, p.message, "remove the k/v scales of non-attention layers"))
        elif p.code is Code.KV_SCHEME_MISSING:
            out.append(
                warning(
                    Code.CONFIG_DISAGREEMENT,
                    None,
                    p.message,
                    "add kv_cache_scheme (FP8) to quantization_config, or drop the scales",
                )
            )
        # partial-fused-exclusion / bf16-but-not-ignored / quantized-but-ignored: engine_rules, per version
    return out
