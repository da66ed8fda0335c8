"""The one finding type: a stable code, a severity, the module or tensor, a message and a fix.

Made where a problem is found (qtool.ops.checks for tensors vs architecture, qtool.ops.inspect for
configs, KV scales and engine decisions, qtool.ops.verify for serving constraints) and consumed as data
by inspect, verify, assemble, quantize and build: never re-derived from message text."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"


class Code(str, Enum):
    # structure (headers, index, tensors vs architecture)
    BAD_HEADER = "bad-header"
    TRUNCATED_SHARD = "truncated-shard"
    BAD_INDEX = "bad-index"
    BAD_CONFIG = "bad-config"
    MISSING_TENSOR = "missing-tensor"
    STALE_TENSOR = "stale-tensor"
    DTYPE_MISMATCH = "dtype-mismatch"
    SHAPE_MISMATCH = "shape-mismatch"
    MIXED_EXPERT_LAYOUT = "mixed-expert-layout"
    CONFIG_DISAGREEMENT = "config-disagreement"
    MISSING_QUANT_TENSOR = "missing-quant-tensor"  # a quantized module without one of its scales
    EXPECTATION_NOT_MET = "expectation-not-met"  # an operation's promise about its output (checks)
    # engine semantics
    QUANTIZED_BUT_IGNORED = "quantized-but-ignored"
    BF16_BUT_NOT_IGNORED = "bf16-but-not-ignored"
    PARTIAL_FUSED_EXCLUSION = "partial-fused-exclusion"
    ENGINE_RULES_NOT_MODELLED = "engine-rules-not-modelled"  # warning: fp8 / AutoAWQ / GPTQ configs
    ENGINE_REJECTS_CONFIG = "engine-rejects-config"  # a quant algo, KV / weight scheme or layer type it lacks
    # serving constraints
    SCALE_MISMATCH = "scale-mismatch"
    MOE_SCHEME_MISMATCH = "moe-scheme-mismatch"  # gate/up vs down of one layer's experts in different schemes
    INPUT_SCALE_MISSING = "input-scale-missing"  # W4A4 NVFP4 module without its activation scale
    ATTENTION_GATE_QUANTIZED = "attention-gate-quantized"  # warning: q_proj (with the output gate) in NVFP4
    TP_DIVISIBILITY = "tp-divisibility"
    MTP_MISSING = "mtp-missing"
    MTP_NOT_EXCLUDED = "mtp-not-excluded"
    MTP_UNSTABLE = "mtp-unstable"  # warning: more speculative tokens than the GDN backend serves stably
    KV_SCALES_MISSING = "kv-scales-missing"
    KV_SCALES_UNCALIBRATED = "kv-scales-uncalibrated"
    KV_SCALES_STALE = "kv-scales-stale"
    KV_SCALE_INVALID = "kv-scale-invalid"
    KV_SCHEME_MISSING = "kv-scheme-missing"
    KV_SCHEME_MISMATCH = "kv-scheme-mismatch"  # per-head scales under a per-tensor kv_cache_scheme, or back
    KV_SCALES_IGNORED = "kv-scales-ignored"  # KV scales the engine skips (a spelling or a scheme it lacks)
    DOES_NOT_FIT = "does-not-fit"
    REMOTE_CODE = "remote-code"  # warning: auto_map / .py files: the engines would run the checkpoint's code
    # --deep
    HASH_MISMATCH = "hash-mismatch"
    NAN_INF = "nan-inf"
    SCALE_OUT_OF_RANGE = "scale-out-of-range"
    ALL_ZERO = "all-zero"


@dataclass(frozen=True)
class Finding:
    code: Code
    severity: Severity
    module: str | None  # module, tensor or shard the finding is about
    message: str
    fix: str | None = None
    engine: str | None = None  # "vllm@0.33.0" when the finding depends on an engine version

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_json(self) -> dict:
        d = {
            "code": self.code.value,
            "severity": self.severity.value,
            "module": self.module,
            "message": self.message,
            "fix": self.fix,
        }
        if self.engine is not None:
            d["engine"] = self.engine
        return d

    @classmethod
    def from_json(cls, d: dict) -> Finding:
        return cls(
            Code(d["code"]), Severity(d["severity"]), d.get("module"), d["message"], d.get("fix"), d.get("engine")
        )


def error(code: Code, module: str | None, message: str, fix: str | None = None, engine: str | None = None) -> Finding:
    return Finding(code, Severity.ERROR, module, message, fix, engine)


def warning(code: Code, module: str | None, message: str, fix: str | None = None, engine: str | None = None) -> Finding:
    return Finding(code, Severity.WARNING, module, message, fix, engine)


def by_severity(found: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(errors, warnings) of `found`, each in its order: what fails a check, and what it reports beside
    (every command that decides pass or fail from findings splits them here)."""
    return [f for f in found if f.is_error], [f for f in found if not f.is_error]


def patch_cmd(ckpt: str, *args: str) -> str:
    import shlex

    return "qtool patch-config " + shlex.join([ckpt, *args])
