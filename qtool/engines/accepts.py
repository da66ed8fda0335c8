"""Which config values vLLM 0.33 and SGLang 0.5.23 load, as data: anything else they refuse at start-up or
build something other than what the checkpoint holds.

Read from the engines' own files (the engines-marked test tests/engines/test_accepts_oracle.py compares these
tables with the real packages where a venv with them exists):
- ModelOpt `quant_algo`: vLLM vllm/model_executor/layers/quantization/modelopt.py `QUANT_ALGOS` (upper-cased
  before the check; anything else is "ModelOpt currently only supports: ..."); SGLang
  python/sglang/srt/layers/quantization/modelopt_quant.py builds ModelOptFp8Config (FP8),
  ModelOptFp4Config (NVFP4, W4A16_NVFP4) and ModelOptMixedPrecisionConfig (MIXED_PRECISION) only.
- ModelOpt `kv_cache_quant_algo` (hf_quant_config.json): vLLM modelopt.py `KV_CACHE_QUANT_ALGOS`; SGLang
  modelopt_quant.py builds its KV-cache method for FP8 only.
- `kv_cache_scheme` (config.json): vLLM compressed_tensors/compressed_tensors.py
  CompressedTensorsKVCacheMethod.validate_kv_cache_scheme refuses all but `type: float, num_bits: 8`
  ("Currently supported kv cache quantization is num_bits=8, type=float"), and modelopt.py from_config
  reads only that one as FP8 (any other is dropped: no quantized KV cache); SGLang compressed_tensors.py
  CompressedTensorsKVCacheMethod.is_supported_scheme likewise.
- compressed-tensors `config_groups` weights x input activations: the schemes vLLM's
  compressed_tensors.py `_get_scheme_from_parts` maps to a class under compressed_tensors/schemes/ (else
  "No compressed-tensors compatible scheme was found"); SGLang's compressed_tensors.py `_get_scheme_from_parts`
  knows fewer (no W4A8 schemes).
- `layer_types`: vLLM models/qwen3_5.py Qwen3_5DecoderLayer raises "Invalid layer_type" for anything but
  these two; SGLang configs/qwen3_5.py maps them to `layers_block_type` and models/qwen3_5.py
  ALL_DECODER_LAYER_TYPES has a decoder layer for those two only.
Older releases qtool models accept no more than these (the lists only grew), so the newest tables stand for
every version.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.engines import Engine

FLOAT4, FLOAT8, INT4, INT8 = ("float", 4), ("float", 8), ("int", 4), ("int", 8)

MODELOPT_QUANT_ALGOS = {
    Engine.VLLM: frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8",
                            "MIXED_PRECISION"}),
    Engine.SGLANG: frozenset({"FP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"}),
}
MODELOPT_KV_CACHE_QUANT_ALGOS = {Engine.VLLM: frozenset({"FP8", "NVFP4"}), Engine.SGLANG: frozenset({"FP8"})}
KV_CACHE_SCHEMES = {Engine.VLLM: frozenset({FLOAT8}), Engine.SGLANG: frozenset({FLOAT8})}

# (weights, input activations or None for weight-only)
_SHARED_CT_SCHEMES = {
    (FLOAT4, FLOAT4),  # NVFP4 / MXFP4 W4A4
    (FLOAT4, None),  # NVFP4A16
    (FLOAT8, FLOAT8),  # FP8 W8A8
    (FLOAT8, None),  # FP8 W8A16
    (INT4, None), (INT8, None),  # WNA16 (GPTQ / AWQ packed)
    (INT8, INT8),  # INT8 W8A8
}
COMPRESSED_TENSORS_SCHEMES = {
    Engine.VLLM: frozenset(_SHARED_CT_SCHEMES | {(INT4, INT8), (INT4, FLOAT8)}),  # + W4A8 int / fp8
    Engine.SGLANG: frozenset(_SHARED_CT_SCHEMES),
}
# What a ModelOpt algorithm stores its weights as: a config.json `config_groups` saying otherwise describes
# tensors the engine, which builds by quant_algo, does not build
MODELOPT_WEIGHTS = {"FP8": FLOAT8, "FP8_PER_CHANNEL_PER_TOKEN": FLOAT8, "FP8_PB_WO": FLOAT8, "MXFP8": FLOAT8,
                    "NVFP4": FLOAT4, "W4A16_NVFP4": FLOAT4}
LAYER_TYPES = {Engine.VLLM: frozenset({"full_attention", "linear_attention"}),
               Engine.SGLANG: frozenset({"full_attention", "linear_attention"})}


@dataclass(frozen=True)
class Refusal:
    """One config value an engine does not load: where it is, what it says, and what the engine takes."""

    key: str  # e.g. "config.json quantization_config.quant_algo"
    got: object
    accepted: str  # what the engine loads instead, in words


def _spec(d: object) -> tuple[str, int] | None:
    """(type, num_bits) of a quantization args dict, or None when absent."""
    if not isinstance(d, dict):
        return None
    return (str(d.get("type")), d.get("num_bits"))


def _scheme_words(schemes) -> str:
    """`weights/activations` pairs, e.g. "float4/float4, int4/none"."""
    def one(spec):
        return "none" if spec is None else f"{spec[0]}{spec[1]}"
    return "weights/activations " + ", ".join(sorted(f"{one(w)}/{one(a)}" for w, a in schemes))


def _modelopt_algo_refusals(engine: Engine, algo: object, key: str) -> list[Refusal]:
    accepted = MODELOPT_QUANT_ALGOS[engine]
    if str(algo).upper() in accepted:
        return []
    return [Refusal(key, algo, ", ".join(sorted(accepted)))]


def _kv_scheme_refusals(engine: Engine, scheme: object, key: str) -> list[Refusal]:
    if not isinstance(scheme, dict):
        return []
    if _spec(scheme) in KV_CACHE_SCHEMES[engine]:
        return []
    return [Refusal(key, {k: scheme.get(k) for k in ("type", "num_bits")},
                    "type float, num_bits 8 (an FP8 KV cache)")]


def _group_refusals(engine: Engine, qc: dict, method: str, algo: str | None) -> list[Refusal]:
    groups = qc.get("config_groups")
    out: list[Refusal] = []
    for name, group in sorted(groups.items()) if isinstance(groups, dict) else []:
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            continue
        weights, acts = _spec(group["weights"]), _spec(group.get("input_activations"))
        key = f"config.json quantization_config.config_groups.{name}.weights"
        got = {"type": weights[0], "num_bits": weights[1]}
        if method == "compressed-tensors" and (weights, acts) not in COMPRESSED_TENSORS_SCHEMES[engine]:
            act = None if acts is None else {"type": acts[0], "num_bits": acts[1]}
            out.append(Refusal(key, {**got, "input_activations": act},
                               _scheme_words(COMPRESSED_TENSORS_SCHEMES[engine])))
        elif method == "modelopt" and algo in MODELOPT_WEIGHTS and weights != MODELOPT_WEIGHTS[algo]:
            want = MODELOPT_WEIGHTS[algo]
            out.append(Refusal(key, got, f"type {want[0]}, num_bits {want[1]} (it builds quant_algo {algo}'s "
                               "weights)"))
    return out


def quant_refusals(engine: Engine, config: dict | None, hf_quant_config: dict | None) -> list[Refusal]:
    """The quantization settings `engine` does not load, from the file it reads: config.json's
    quantization_config when there is one, else hf_quant_config.json (both engines' order)."""
    qc = (config or {}).get("quantization_config")
    if isinstance(qc, dict):
        method = str(qc.get("quant_method") or "")
        algo = str(qc.get("quant_algo") or "").upper() or None
        out: list[Refusal] = []
        if method.startswith("modelopt") and "quant_algo" in qc:
            out += _modelopt_algo_refusals(engine, qc["quant_algo"], "config.json quantization_config.quant_algo")
        if method.startswith("modelopt") or method == "compressed-tensors":
            out += _kv_scheme_refusals(engine, qc.get("kv_cache_scheme"),
                                       "config.json quantization_config.kv_cache_scheme")
            out += _group_refusals(engine, qc, "modelopt" if method.startswith("modelopt") else method, algo)
        return out
    body = (hf_quant_config or {}).get("quantization")
    if not isinstance(body, dict):
        body = hf_quant_config or {}
    out = []
    if body.get("quant_algo") is not None:
        out += _modelopt_algo_refusals(engine, body["quant_algo"], "hf_quant_config.json quant_algo")
    kv = body.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() not in MODELOPT_KV_CACHE_QUANT_ALGOS[engine]:
        out.append(Refusal("hf_quant_config.json kv_cache_quant_algo", kv,
                           ", ".join(sorted(MODELOPT_KV_CACHE_QUANT_ALGOS[engine]))))
    return out


def layer_type_refusals(engine: Engine, text_config: dict | None) -> list[Refusal]:
    """Entries of `text_config.layer_types` the engine has no decoder layer for."""
    types = (text_config or {}).get("layer_types")
    accepted = LAYER_TYPES[engine]
    return [Refusal(f"config.json text_config.layer_types[{i}]", t, ", ".join(sorted(accepted)))
            for i, t in enumerate(types if isinstance(types, list) else []) if t not in accepted]
