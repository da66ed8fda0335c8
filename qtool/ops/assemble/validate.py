"""Source validation for a hybrid assembly, before anything is written: the two sources are the same model,
the BF16 tensors have the architecture's shapes and dtypes, a grafted MTP head is complete."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import PlanError
from qtool.io.checkpoint import Checkpoint
from qtool.io.dtypes import FLOAT_DTYPES
from qtool.io.safetensors_header import TensorInfo


def _need(cfg: dict, key: str, where: Path) -> int:
    v = cfg.get(key)
    if not isinstance(v, int):
        raise PlanError(
            f"config lacks text_config.{key}",
            path=where / "config.json",
            hint="the checkpoint's config.json is not a Qwen3.5-MoE config",
        )
    return v


ARCH_KEYS = (
    "hidden_size",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_hidden_layers",
)


def check_same_model(nv: Checkpoint, bf: Checkpoint) -> None:
    a, b = nv.text_config, bf.text_config
    if not b:
        return  # shapes are still checked tensor by tensor
    for key in ARCH_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise PlanError(
                f"the two sources are different models: text_config.{key} differs",
                path=bf.root / "config.json",
                expected=f"{a[key]} (NVFP4 source)",
                got=f"{b[key]} (BF16 source)",
                hint="pass the BF16 original of the model the NVFP4 checkpoint was quantized from",
            )


class ArchShapes:
    """Shapes the architecture (config) requires of the tensors this assembly writes."""

    def __init__(self, cfg: dict, root: Path) -> None:
        self.H = _need(cfg, "hidden_size", root)
        self.E = _need(cfg, "num_experts", root)
        self.I = _need(cfg, "moe_intermediate_size", root)
        self.Is = cfg.get("shared_expert_intermediate_size", self.I)
        self.L = _need(cfg, "num_hidden_layers", root)

    def shared(self, proj: str) -> tuple[int, ...]:
        return (self.H, self.Is) if proj == "down_proj" else (self.Is, self.H)

    def expert(self, proj: str) -> tuple[int, ...]:
        return (self.H, self.I) if proj == "down_proj" else (self.I, self.H)


def check_bf16_tensor(name: str, info: TensorInfo, shape: tuple[int, ...], what: str) -> None:
    if info.dtype not in FLOAT_DTYPES:
        raise PlanError(
            f"BF16 source tensor for the {what} is not a float tensor",
            path=info.file,
            tensor=name,
            expected="BF16/F16/F32",
            got=info.dtype,
            hint="--bf16 must point at the unquantized original",
        )
    if tuple(info.shape) != tuple(shape):
        raise PlanError(
            f"BF16 source tensor for the {what} has the wrong shape for this architecture",
            path=info.file,
            tensor=name,
            expected=list(shape),
            got=list(info.shape),
            hint="the two sources are different models (compare hidden_size / "
            "moe_intermediate_size / num_experts in their config.json)",
        )


# What an MTP head must hold to be built by the engines' drafters (vLLM qwen3_5_mtp.py, SGLang
# qwen3_5_mtp.py): the input projection and norms, one decoder layer's attention and MoE.
MTP_REQUIRED = (
    "mtp.fc.",
    "mtp.norm.",
    "mtp.pre_fc_norm_embedding.",
    "mtp.pre_fc_norm_hidden.",
    "mtp.layers.0.self_attn.q_proj.",
    "mtp.layers.0.self_attn.k_proj.",
    "mtp.layers.0.self_attn.v_proj.",
    "mtp.layers.0.self_attn.o_proj.",
    "mtp.layers.0.mlp.gate.",
    "mtp.layers.0.mlp.experts.",
)


def check_mtp_complete(names: list[str], root: Path) -> None:
    """Refuse to graft an incomplete MTP head before anything is written (found only by the output
    checks, after every shard was copied, before)."""
    missing = [r.rstrip(".") for r in MTP_REQUIRED if not any(n.startswith(r) for n in names)]
    if missing:
        raise PlanError(
            f"the BF16 source's MTP head is incomplete: no {', '.join(missing[:4])}"
            + (" ..." if len(missing) > 4 else ""),
            path=root,
            tensor=missing[0],
            hint="download the BF16 source's MTP tensors completely (qtool download ... --tensors "
            "'re:^mtp\\.'), or pass --mtp drop / --mtp keep",
        )
