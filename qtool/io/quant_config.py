"""Where each config schema keeps its quantization facts (docs/formats.md §3-5).

config.json `quantization_config`:
  ModelOpt export:        quant_method "modelopt", quant_algo, ignore [...], kv_cache_scheme
  compressed-tensors:     quant_method "compressed-tensors", format, config_groups, ignore [...] (exact
                          names and `re:` regexes), kv_cache_scheme
  AutoAWQ:                quant_method "awq", modules_to_not_convert [...]
hf_quant_config.json:
  ModelOpt native:        {"producer": ..., "quantization": {"quant_algo", "kv_cache_quant_algo",
                          "exclude_modules": [...]}}
  flat (community):       {"quant_algo": ..., "ignore": [...]} at top level
vLLM and SGLang read config.json's quantization_config first and fall back to hf_quant_config.json
(vllm/model_executor/layers/quantization/modelopt.py, sglang .../modelopt_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class HfQuantSchema(str, Enum):
    MODELOPT_NATIVE = "modelopt-native"  # quantization.exclude_modules
    FLAT = "flat"  # top-level ignore


def config_ignore_key(quant_config: dict) -> str:
    """AutoAWQ: modules_to_not_convert; AMD Quark: exclude; ModelOpt and compressed-tensors: ignore."""
    method = str(quant_config.get("quant_method"))
    return {"awq": "modules_to_not_convert", "quark": "exclude"}.get(method, "ignore")


def config_ignore(config: dict | None) -> list[str] | None:
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict):
        return None
    return list(qc.get(config_ignore_key(qc)) or [])


def hf_quant_schema(hf_quant_config: dict) -> HfQuantSchema:
    return (
        HfQuantSchema.MODELOPT_NATIVE if isinstance(hf_quant_config.get("quantization"), dict) else HfQuantSchema.FLAT
    )


def hf_quant_exclude(hf_quant_config: dict | None) -> list[str] | None:
    if not hf_quant_config:
        return None
    if hf_quant_schema(hf_quant_config) is HfQuantSchema.MODELOPT_NATIVE:
        return list(hf_quant_config["quantization"].get("exclude_modules") or [])
    return list(hf_quant_config.get("ignore") or hf_quant_config.get("exclude_modules") or [])


def set_config_ignore(config: dict, patterns: list[str]) -> None:
    qc = config["quantization_config"]
    qc[config_ignore_key(qc)] = patterns


def set_hf_quant_exclude(hf_quant_config: dict, patterns: list[str]) -> None:
    if hf_quant_schema(hf_quant_config) is HfQuantSchema.MODELOPT_NATIVE:
        hf_quant_config["quantization"]["exclude_modules"] = patterns
    elif "exclude_modules" in hf_quant_config and "ignore" not in hf_quant_config:
        hf_quant_config["exclude_modules"] = patterns
    else:
        hf_quant_config["ignore"] = patterns


@dataclass
class QuantSummary:
    quant_method: str | None
    quant_algo: str | None
    format: str | None
    ignore: list[str] | None  # config.json quantization_config.ignore
    hf_quant_schema: str | None
    hf_quant_algo: str | None
    hf_exclude: list[str] | None
    kv_cache_scheme: dict | None
    kv_cache_quant_algo: str | None
    config_groups: int | None = None  # compressed-tensors: number of weight schemes (0: KV cache only)

    @property
    def effective_ignore(self) -> list[str] | None:
        """What the engines use: config.json first, hf_quant_config.json only when that is absent."""
        return self.ignore if self.quant_method is not None else self.hf_exclude

    @property
    def quantized(self) -> bool:
        return self.quant_method is not None or self.hf_quant_algo is not None

    @property
    def weights_quantized(self) -> bool:
        """False for KV-cache-only configs (llm-compressor's `format: dense` with `config_groups: {}`):
        the engines then quantize no Linear at all, whatever `ignore` says."""
        if self.quant_method == "compressed-tensors" and self.config_groups == 0:
            return False
        return self.quantized

    def to_json(self) -> dict:
        return {
            "quant_method": self.quant_method,
            "quant_algo": self.quant_algo,
            "format": self.format,
            "ignore": self.ignore,
            "kv_cache_scheme": self.kv_cache_scheme,
            "hf_quant_config": None
            if self.hf_quant_schema is None
            else {
                "schema": self.hf_quant_schema,
                "quant_algo": self.hf_quant_algo,
                "exclude_modules": self.hf_exclude,
                "kv_cache_quant_algo": self.kv_cache_quant_algo,
            },
        }


def summarize(config: dict | None, hf_quant_config: dict | None) -> QuantSummary:
    qc = (config or {}).get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    schema = algo = kv_algo = None
    if hf_quant_config:
        s = hf_quant_schema(hf_quant_config)
        schema = s.value
        body = hf_quant_config["quantization"] if s is HfQuantSchema.MODELOPT_NATIVE else hf_quant_config
        algo = body.get("quant_algo")
        kv_algo = body.get("kv_cache_quant_algo")
    return QuantSummary(
        quant_method=qc.get("quant_method"),
        quant_algo=qc.get("quant_algo"),
        format=qc.get("format"),
        ignore=config_ignore(config),
        hf_quant_schema=schema,
        hf_quant_algo=algo,
        hf_exclude=hf_quant_exclude(hf_quant_config),
        kv_cache_scheme=qc.get("kv_cache_scheme"),
        kv_cache_quant_algo=kv_algo,
        config_groups=len(qc["config_groups"]) if isinstance(qc.get("config_groups"), dict) else None,
    )
