"""Realistic Qwen3.5-397B-A17B Linear module names (docs/formats.md §2), built small enough for tests."""

from __future__ import annotations

LM = "model.language_model.layers"


def full_attention(i: int) -> bool:
    return (i + 1) % 4 == 0


def layer_modules(prefix: str, attention: bool, n_experts: int) -> dict[str, list[str]]:
    attn = (
        [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if attention
        else [f"{prefix}.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
    )
    return {
        "attn": attn,
        "router": [f"{prefix}.mlp.gate"],
        "shared_expert": [f"{prefix}.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
        "shared_expert_gate": [f"{prefix}.mlp.shared_expert_gate"],
        "experts": [
            f"{prefix}.mlp.experts.{e}.{p}" for e in range(n_experts) for p in ("gate_proj", "up_proj", "down_proj")
        ],
    }


def model_modules(n_layers: int = 60, n_experts: int = 4, vision_depth: int = 2) -> dict[str, dict[str, list[str]]]:
    """{group: {part: [module]}} with groups "layer.N", "mtp", "visual", "lm_head"."""
    out: dict[str, dict[str, list[str]]] = {}
    for i in range(n_layers):
        out[f"layer.{i}"] = layer_modules(f"{LM}.{i}", full_attention(i), n_experts)
    mtp = layer_modules("mtp.layers.0", True, n_experts)
    mtp["fc"] = ["mtp.fc"]
    out["mtp"] = mtp
    vis = []
    for b in range(vision_depth):
        vis += [f"model.visual.blocks.{b}.attn.qkv", f"model.visual.blocks.{b}.attn.proj"]
        vis += [f"model.visual.blocks.{b}.mlp.linear_fc1", f"model.visual.blocks.{b}.mlp.linear_fc2"]
    vis += ["model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]
    out["visual"] = {"all": vis}
    out["lm_head"] = {"all": ["lm_head"]}
    return out


def flatten(groups: dict[str, dict[str, list[str]]]) -> list[str]:
    return [m for parts in groups.values() for ms in parts.values() for m in ms]
