"""`engine-rejects-config`: config values an engine does not load (qtool.engines.accepts holds what each
engine takes, with the upstream files), one error per value and engine, naming the key."""

from __future__ import annotations

from qtool.engines import EngineVersion
from qtool.engines.accepts import Refusal, layer_type_refusals, quant_refusals
from qtool.findings import Code, Finding, error
from qtool.io.checkpoint import Checkpoint


def _fix(refusal: Refusal, ckpt: str) -> str:
    key = refusal.key
    if "kv_cache" in key:
        return (
            f"qtool calibrate-kv {ckpt} -o OUT --replace-scales (an FP8 KV scheme with calibrated scales, which "
            "both engines load), or remove the KV setting to serve an unquantized KV cache"
        )
    if "layer_types" in key:
        return "restore config.json from the source repository (Qwen3.5 layers are full_attention or linear_attention)"
    if ".weights" in key:
        return (
            "make config_groups describe the tensors: restore config.json from the exporter's output, or "
            "requantize (qtool quantize)"
        )
    return "restore the quantization config from the exporter's output, or requantize (qtool quantize writes NVFP4)"


def refusal_findings(ckpt: Checkpoint, versions: list[EngineVersion]) -> list[Finding]:
    """Errors for each quant algorithm, KV / weight scheme and layer type an engine in `versions` refuses."""
    out: list[Finding] = []
    for v in versions:
        found = quant_refusals(v.engine, ckpt.config, ckpt.hf_quant_config)
        found += layer_type_refusals(v.engine, ckpt.text_config)
        for r in found:
            out.append(
                error(
                    Code.ENGINE_REJECTS_CONFIG,
                    r.key,
                    f"{v} does not load {r.key} = {r.got!r}: it takes {r.accepted}",
                    _fix(r, str(ckpt.root)),
                    engine=str(v),
                )
            )
    return out
