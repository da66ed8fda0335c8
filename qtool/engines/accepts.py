"""Which config values vLLM 0.33 and SGLang 0.5.23 load, as data: anything else they refuse at start-up or
build something other than what the checkpoint holds.

Read from the engines' own files, and checked against them by the engines-marked test
tests/engines/test_accepts_oracle.py (tests/engines/accepts_runner.py probes the installed packages):
- ModelOpt `quant_algo`: vLLM model_executor/layers/quantization/modelopt.py `QUANT_ALGOS` (upper-cased in
  ModelOptQuantConfigBase.from_config, else "ModelOpt currently only supports: ..."). SGLang
  configs/model_config.py ModelConfig._parse_modelopt_quant_config picks the method by name (an unknown name in
  hf_quant_config.json builds the model unquantized), then layers/quantization/modelopt_quant.py
  ModelOptFp4Config.from_config takes FP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4, ModelOptFp8Config FP8 and
  ModelOptMixedPrecisionConfig MIXED_PRECISION; MXFP8 goes to layers/quantization/fp8.py Fp8Config ("mxfp8").
- ModelOpt `kv_cache_quant_algo` (hf_quant_config.json): vLLM utils/torch_utils.py
  get_kv_cache_quant_algo_string maps it through MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP (fp8, nvfp4; anything
  else falls back to an unquantized "auto" cache); SGLang mem_cache/kv_cache_dtype.py configure_kv_cache_dtype
  quantizes the cache for FP8 only.
- `kv_cache_scheme` (config.json): vLLM compressed_tensors/compressed_tensors.py
  CompressedTensorsKVCacheMethod.validate_kv_cache_scheme refuses all but `type: float, num_bits: 8`;
  modelopt.py ModelOptQuantConfigBase.from_config sets a KV method for that one only (others: no KV scales
  loaded). SGLang compressed_tensors.py CompressedTensorsKVCacheMethod.is_supported_scheme and
  modelopt_quant.py from_config (float 8 -> "FP8") likewise.
- compressed-tensors `config_groups` weights x input activations: the pairs `_get_scheme_from_parts` in each
  engine's compressed_tensors.py maps to a scheme on an H100 or B200 for some layout an exporter writes (else
  "No compressed-tensors compatible scheme was found"). vLLM's MXFP4 / MXFP8 weight schemes take any input
  activations, hence the wide float4 / float8 rows.
- `layer_types`: vLLM models/qwen3_5.py Qwen3_5DecoderLayer builds full_attention and linear_attention ("Invalid
  layer_type" otherwise), after transformers' configuration_utils.py _LEGACY_LAYER_TYPE_REMAP renamed
  "attention" and "mamba" to those. SGLang does not read `layer_types`: configs/qwen3_next.py
  layers_block_type follows `full_attention_interval` (None below: no refusal).
Older releases qtool models accept no more than these (the lists only grew), so the newest tables stand for
every version.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.engines.base import Engine

FLOAT4, FLOAT8, INT4, INT8 = ("float", 4), ("float", 8), ("int", 4), ("int", 8)

MODELOPT_QUANT_ALGOS = {
    Engine.VLLM: frozenset(
        {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"}
    ),
    Engine.SGLANG: frozenset({"FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"}),
}
MODELOPT_KV_CACHE_QUANT_ALGOS = {Engine.VLLM: frozenset({"FP8", "NVFP4"}), Engine.SGLANG: frozenset({"FP8"})}
KV_CACHE_SCHEMES = {Engine.VLLM: frozenset({FLOAT8}), Engine.SGLANG: frozenset({FLOAT8})}

# (weights, input activations or None for weight-only)
_ANY_INPUT = (None, FLOAT4, FLOAT8, INT4, INT8)
COMPRESSED_TENSORS_SCHEMES = {
    Engine.VLLM: frozenset(
        {(FLOAT4, a) for a in _ANY_INPUT}  # NVFP4 / NVFP4A16, MXFP4 (any input)
        | {(FLOAT8, a) for a in _ANY_INPUT}  # FP8 W8A8 / W8A16, MXFP8 (any input)
        | {(INT4, None), (INT8, None)}  # WNA16 (GPTQ / AWQ packed)
        | {(INT4, INT4), (INT4, INT8), (INT8, INT4), (INT8, INT8)}  # W4A8 / WNA8 / WNA4 int
        | {(INT4, FLOAT8), (INT8, FLOAT8)}
    ),  # W4A8 fp8 (H100), int8 static W8A8
    Engine.SGLANG: frozenset(
        {
            (FLOAT4, FLOAT4),
            (FLOAT4, None),  # NVFP4, NVFP4A16
            (FLOAT8, FLOAT4),
            (FLOAT8, FLOAT8),
            (FLOAT8, INT4),
            (FLOAT8, INT8),
            (FLOAT8, None),  # FP8 W8A8, W8A16 (any input)
            (INT4, None),
            (INT8, None),  # WNA16
            (INT8, INT8),
            (INT8, FLOAT8),
        }
    ),  # INT8 W8A8 (bits checked, not type)
}
# What a ModelOpt algorithm stores its weights as: a config.json `config_groups` saying otherwise describes
# tensors the engine, which builds by quant_algo, does not build
MODELOPT_WEIGHTS = {
    "FP8": FLOAT8,
    "FP8_PER_CHANNEL_PER_TOKEN": FLOAT8,
    "FP8_PB_WO": FLOAT8,
    "MXFP8": FLOAT8,
    "NVFP4": FLOAT4,
    "W4A16_NVFP4": FLOAT4,
}
LAYER_TYPES: dict[Engine, frozenset[str] | None] = {
    Engine.VLLM: frozenset({"full_attention", "linear_attention", "attention", "mamba"}),
    Engine.SGLANG: None,
}


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
    return [Refusal(key, {k: scheme.get(k) for k in ("type", "num_bits")}, "type float, num_bits 8 (an FP8 KV cache)")]


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
            out.append(
                Refusal(key, {**got, "input_activations": act}, _scheme_words(COMPRESSED_TENSORS_SCHEMES[engine]))
            )
        elif method == "modelopt" and algo in MODELOPT_WEIGHTS and weights != MODELOPT_WEIGHTS[algo]:
            want = MODELOPT_WEIGHTS[algo]
            out.append(Refusal(key, got, f"type {want[0]}, num_bits {want[1]} (it builds quant_algo {algo}'s weights)"))
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
            out += _kv_scheme_refusals(
                engine, qc.get("kv_cache_scheme"), "config.json quantization_config.kv_cache_scheme"
            )
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
        out.append(
            Refusal(
                "hf_quant_config.json kv_cache_quant_algo", kv, ", ".join(sorted(MODELOPT_KV_CACHE_QUANT_ALGOS[engine]))
            )
        )
    return out


def layer_type_refusals(engine: Engine, text_config: dict | None) -> list[Refusal]:
    """Entries of `text_config.layer_types` the engine has no decoder layer for."""
    types = (text_config or {}).get("layer_types")
    accepted = LAYER_TYPES[engine]
    if accepted is None:  # the engine does not read layer_types
        return []
    return [
        Refusal(f"config.json text_config.layer_types[{i}]", t, ", ".join(sorted(accepted)))
        for i, t in enumerate(types if isinstance(types, list) else [])
        if t not in accepted
    ]
