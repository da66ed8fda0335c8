"""`qtool calibrate-kv`: per-tensor FP8 E4M3 KV-cache scales for every full-attention layer.

k_scale = amax(K) / 448, v_scale = amax(V) / 448 over all calibration tokens, where K and V are what an
engine writes into its KV cache: K after k_proj, k_norm and the (partial, mrope) rotary embedding, V
after v_proj. They are captured at the attention kernel's inputs (qtool.stream.layer_stream.attention_tap:
the tensors transformers' Qwen3_5MoeAttention passes to its attention function, after
apply_rotary_pos_emb), during a layer-streamed forward of the dequantized model. GDN layers have no
KV cache and get no scales; the MTP head's attention layer is not calibrated (it needs the MTP forward).

Output in the checkpoint's own convention (docs/formats.md §3 and §4):
  ModelOpt              `...self_attn.k_proj.k_scale`, `...self_attn.v_proj.v_scale`
  compressed-tensors    `...self_attn.k_scale`, `...self_attn.v_scale`   (also BF16, FP8 and AWQ models)
float32 scalars in ONE new shard added to the index (other shards reused unchanged), plus
`kv_cache_scheme` in config.json's quantization_config and `kv_cache_quant_algo: FP8` in
hf_quant_config.json. A model with neither config gets llm-compressor's KV-cache-only
quantization_config (docs/formats.md §4).

Plan -> validate -> execute: `plan()` reads headers and configs only; `calibrate()` runs the forward
(resumable: a journal plus the hidden states after the last finished layer live in the work directory);
`write.output_plan()` decides every output file before calibration (the KV scales are its Pending values),
and the shared executor (qtool.io.apply) writes `-o OUT` through `OUT.partial/` or, in place, builds the
new state beside the checkpoint and swaps it in.
"""

from qtool.ops.calibrate_kv.calibrate import LayerStat, calibrate, outlier_warnings
from qtool.ops.calibrate_kv.execute import execute, run
from qtool.ops.calibrate_kv.plan import JOURNAL, KV_SHARD, OUTLIER_RATIO, CalibrateKvOptions, KvPlan, plan, scale_names
from qtool.ops.calibrate_kv.scheme import CT_KV_SCHEME, MODELOPT_KV_SCHEME, Convention, kv_only_quantization_config
from qtool.ops.calibrate_kv.write import output_plan, scale_values

__all__ = [
    "CT_KV_SCHEME",
    "JOURNAL",
    "KV_SHARD",
    "MODELOPT_KV_SCHEME",
    "OUTLIER_RATIO",
    "CalibrateKvOptions",
    "Convention",
    "KvPlan",
    "LayerStat",
    "calibrate",
    "execute",
    "kv_only_quantization_config",
    "outlier_warnings",
    "plan",
    "run",
    "scale_names",
    "output_plan",
    "scale_values",
]
