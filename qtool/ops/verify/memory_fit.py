"""Memory fit of a checkpoint on a TP group: per-GPU weights, KV cache per token, GDN state per
sequence, a fixed reserve; then the largest context or the number of sequences that fit.

Model (per GPU, bytes; all from headers and config, no data read):
- budget = gpu_memory_utilization x GPU memory (vLLM's gpu_memory_utilization / SGLang's
  mem_fraction_static bound everything the engine allocates);
- weights: every tensor divided by TP, except what TP replicates: norms, the router (`mlp.gate`) and
  `shared_expert_gate` (ReplicatedLinear in vLLM models/qwen3_next.py / qwen3_5.py), scalars, and the
  K/V projections when TP > num_key_value_heads (QKVParallelLinear replicates KV heads: each GPU holds
  max(1, nkv/TP) of them). The vision tower is counted whole on every GPU (served with
  `--mm-encoder-tp-mode data`, which replicates it). The MTP head counts only with --mtp > 0;
- KV cache per token: (full-attention layers [+ MTP layers with --mtp]) x 2 (K, V) x KV heads per GPU x
  head_dim x (1 byte fp8 | 2 bytes auto=BF16). Gated-DeltaNet layers have no KV cache;
- GDN state per sequence: linear-attention layers x (conv state (kernel-1) x conv_dim/TP + recurrent
  state value_heads/TP x k_dim x v_dim) x 2 bytes (BF16 state, vLLM mamba_ssm_cache_dtype "auto");
- reserve: RESERVE_GIB for activations at the prefill chunk, CUDA graphs and NCCL/cuBLAS workspaces
  (a documented estimate, not measured here).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from qtool.arch.model_map import ModelMap
from qtool.arch.qwen35 import Group
from qtool.errors import UsageError

MIB = 1 << 20
GIB = 1 << 30
# RTX PRO 6000 Blackwell: 97,887 MiB per GPU (docs/formats.md §12).
RTX_PRO_6000_MIB = 97_887
DEFAULT_GPUS = f"4x{RTX_PRO_6000_MIB}MiB"
# Activations for a 4096..8192-token prefill chunk of a hidden-4096 MoE (~1.5 GiB), CUDA graphs (~1 GiB),
# NCCL / cuBLAS / FlashInfer workspaces and allocator slack (~1.5 GiB).
RESERVE_GIB = 4.0
DEFAULT_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
STATE_BYTES = 2  # BF16 conv + recurrent state
_KV_BYTES = {"auto": 2, "bf16": 2, "fp8": 1}
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*([\d.]+)\s*(MiB|GiB|GB|MB)?\s*$")


@dataclass(frozen=True)
class Target:
    num_gpus: int
    gpu_bytes: int

    @classmethod
    def parse(cls, text: str) -> Target:
        """ "4x97887MiB", "8x96GiB", "4x96GB" (decimal) -> Target."""
        m = _SIZE.match(text)
        if not m:
            raise UsageError(f"bad --gpus {text!r}", expected="NxSIZE, e.g. 4x97887MiB, 4x96GiB or 8x96GB")
        if not m.group(3):  # 96 could be GB or GiB (a 7% difference): never guessed
            raise UsageError(
                f"bad --gpus {text!r}: the size needs its unit",
                expected=(
                    f"{m.group(1)}x{m.group(2)}GB, {m.group(1)}x{m.group(2)}GiB or MiB as nvidia-smi prints it "
                    "(an RTX PRO 6000 Blackwell: 4x97887MiB)"
                ),
            )
        n, size, unit = int(m.group(1)), float(m.group(2)), m.group(3)
        mult = {"MiB": MIB, "GiB": GIB, "GB": 10**9, "MB": 10**6}[unit]
        if n < 1 or size <= 0:
            raise UsageError(f"bad --gpus {text!r}: need at least one GPU with memory")
        return cls(n, int(size * mult))


@dataclass
class Fit:
    tp: int
    gpu_gib: float
    budget_gib: float
    weights_per_gpu_gib: float
    reserve_gib: float
    kv_cache_gib: float  # what is left for KV cache + GDN state
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    max_model_len: int
    max_num_seqs: int
    fits: bool
    reason: str
    kv_cache_dtype: str
    breakdown_gib: dict[str, float]
    # the budget at the checked point (max_model_len x max_num_seqs): weights, KV cache, GDN state,
    # reserve and what is left unused; they add up to budget_gib
    usage_gib: dict[str, float] = field(default_factory=dict)
    # sequences that fit at each context length (powers of two from 4096 to the model's context)
    capacity: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        d["breakdown_gib"] = {k: round(v, 3) for k, v in self.breakdown_gib.items()}
        d["usage_gib"] = {k: round(v, 3) for k, v in self.usage_gib.items()}
        return d


def default_context(text_cfg: dict) -> int:
    """max_position_embeddings, times the YaRN factor when the config carries one."""
    base = int(text_cfg.get("max_position_embeddings") or 262144)
    rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn" and rope.get("factor"):
        orig = int(rope.get("original_max_position_embeddings") or base)
        return int(orig * float(rope["factor"]))
    return base


def _share(mod, tp: int, nkv: int) -> float:
    """Fraction of module `mod` (qtool.arch.model_map.Module) that one GPU holds under TP."""
    g = mod.inner
    if mod.group is Group.VISION or g in (
        Group.NORM,
        Group.FINAL_NORM,
        Group.ROUTER,
        Group.SHARED_EXPERT_GATE,
        Group.KV_SCALE,
    ):
        return 1.0
    if mod.name.endswith((".q_norm", ".k_norm", ".norm")):
        return 1.0
    if g is Group.ATTENTION and mod.name.endswith((".k_proj", ".v_proj")):
        return max(1, nkv // tp) / nkv if nkv else 1.0 / tp
    return 1.0 / tp


def weights_per_gpu(mm: ModelMap, tp: int, *, mtp: bool, vision: bool = True) -> dict[str, float]:
    """group -> bytes one GPU holds. Scalars (global scales) are replicated; their bytes are negligible
    and counted as sharded with their module."""
    nkv = int(mm.ckpt.text_config.get("num_key_value_heads") or 0)
    out: dict[str, float] = {}
    for mod in mm.modules.values():
        if (mod.group is Group.MTP and not mtp) or (mod.group is Group.VISION and not vision):
            continue
        b = mod.nbytes() * _share(mod, tp, nkv)
        key = mod.group.value
        out[key] = out.get(key, 0.0) + b
    return out


def kv_bytes_per_token(cfg: dict, n_attn_layers: int, tp: int, kv_cache_dtype: str) -> int:
    nkv = int(cfg.get("num_key_value_heads") or 1)
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    heads_per_gpu = max(1, nkv // tp)
    return n_attn_layers * 2 * heads_per_gpu * hd * _KV_BYTES[kv_cache_dtype]


def state_bytes_per_seq(cfg: dict, n_linear_layers: int, tp: int) -> int:
    nk, dk = int(cfg.get("linear_num_key_heads") or 0), int(cfg.get("linear_key_head_dim") or 0)
    nv, dv = int(cfg.get("linear_num_value_heads") or 0), int(cfg.get("linear_value_head_dim") or 0)
    k = int(cfg.get("linear_conv_kernel_dim") or 4)
    conv_dim = 2 * nk * dk + nv * dv
    conv = (k - 1) * (conv_dim // tp) * STATE_BYTES
    rec = (nv // tp) * dk * dv * STATE_BYTES
    return n_linear_layers * (conv + rec)


def memory_fit(
    mm: ModelMap,
    *,
    tp: int,
    target: Target,
    gpu_memory_utilization: float = DEFAULT_UTILIZATION,
    kv_cache_dtype: str = "auto",
    mtp: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    reserve_gib: float = RESERVE_GIB,
) -> Fit:
    if tp > target.num_gpus:
        raise UsageError(f"--tp {tp} needs {tp} GPUs, --gpus has {target.num_gpus}")
    if not 0 < gpu_memory_utilization <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]", got=gpu_memory_utilization)
    cfg = mm.ckpt.text_config
    has_mtp = bool(mm.modules_in(Group.MTP))
    use_mtp = mtp > 0 and has_mtp
    parts = weights_per_gpu(mm, tp, mtp=use_mtp)
    weights = sum(parts.values())
    n_full = len(mm.full_attention) + (int(cfg.get("mtp_num_hidden_layers") or 1) if use_mtp else 0)
    n_linear = sum(1 for t in mm.layer_types if t == "linear_attention")
    kv_tok = kv_bytes_per_token(cfg, n_full, tp, kv_cache_dtype)
    state = state_bytes_per_seq(cfg, n_linear, tp)
    budget = gpu_memory_utilization * target.gpu_bytes
    reserve = reserve_gib * GIB
    free = budget - weights - reserve
    ctx_default = default_context(cfg)
    reason = ""
    if free <= 0:
        seqs_fit, len_fit = 0, 0
        fits = False
        reason = (
            f"weights ({weights / GIB:.1f} GiB) + reserve ({reserve_gib:.1f} GiB) exceed the per-GPU budget "
            f"({budget / GIB:.1f} GiB = {gpu_memory_utilization} x {target.gpu_bytes / GIB:.1f} GiB)"
        )
        out_len, out_seqs = max_model_len or ctx_default, max_num_seqs or 0
    elif max_model_len is not None and max_num_seqs is not None:
        need = max_num_seqs * (max_model_len * kv_tok + state)
        fits = need <= free
        out_len, out_seqs = max_model_len, max_num_seqs
        if not fits:
            reason = (
                f"{max_num_seqs} sequences x {max_model_len} tokens need {need / GIB:.1f} GiB of KV cache + "
                f"state, {free / GIB:.1f} GiB is left per GPU"
            )
    elif max_num_seqs is not None:
        len_fit = int((free - max_num_seqs * state) // (max_num_seqs * kv_tok)) if free > max_num_seqs * state else 0
        out_len, out_seqs = min(len_fit, ctx_default), max_num_seqs
        fits = out_len > 0
        if not fits:
            reason = f"not even one token per sequence fits for {max_num_seqs} sequences"
    else:
        length = max_model_len or ctx_default
        seqs_fit = int(free // (length * kv_tok + state))
        out_len, out_seqs = length, seqs_fit
        fits = seqs_fit >= 1
        if not fits:
            reason = (
                f"one sequence of {length} tokens needs {(length * kv_tok + state) / GIB:.1f} GiB of KV cache, "
                f"{free / GIB:.1f} GiB is left per GPU"
            )
    seqs_used = out_seqs if fits else 0
    kv_used = seqs_used * out_len * kv_tok
    state_used = seqs_used * state
    usage = {
        "weights": weights,
        "kv_cache": kv_used,
        "gdn_state": state_used,
        "reserve": reserve,
        "unused": max(budget - weights - reserve - kv_used - state_used, 0.0),
    }
    return Fit(
        tp=tp,
        gpu_gib=target.gpu_bytes / GIB,
        budget_gib=budget / GIB,
        weights_per_gpu_gib=weights / GIB,
        reserve_gib=reserve_gib,
        kv_cache_gib=max(free, 0) / GIB,
        kv_bytes_per_token=kv_tok,
        state_bytes_per_seq=state,
        max_model_len=out_len,
        max_num_seqs=out_seqs,
        fits=fits,
        reason=reason,
        kv_cache_dtype=kv_cache_dtype,
        breakdown_gib={k: v / GIB for k, v in sorted(parts.items())},
        usage_gib={k: v / GIB for k, v in usage.items()},
        capacity=capacity_curve(max(free, 0.0), kv_tok, state, ctx_default),
    )


def capacity_curve(free_bytes: float, kv_bytes_per_token: int, state_bytes: int, context: int) -> list[dict]:
    """Sequences that fit in `free_bytes` at context lengths 4096, 8192, ... up to `context` (and
    `context` itself): each sequence holds its KV cache for the whole length plus one GDN state."""
    lengths = []
    length = 4096
    while length < context:
        lengths.append(length)
        length *= 2
    lengths.append(context)
    return [
        {"max_model_len": n, "max_num_seqs": int(free_bytes // (n * kv_bytes_per_token + state_bytes))} for n in lengths
    ]
