"""The vocabulary both engine modules share: the engines and their versions, the HF module units an
ignore list names, and the error for a fused module excluded in part. `qtool.engines` re-exports it."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from qtool.errors import QtoolError, UsageError
from qtool.formats.naming import Flavour  # which quantization_config schema an ignore list belongs to


class Engine(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(frozen=True, order=True)
class EngineVersion:
    engine_name: str
    release: tuple[int, ...]

    @property
    def engine(self) -> Engine:
        return Engine(self.engine_name)

    def __str__(self) -> str:
        return f"{self.engine_name}@{'.'.join(map(str, self.release))}"

    def at_least(self, release: tuple[int, ...]) -> bool:
        return self.release >= release


# Newest release each engine model was written against (read from the released wheels).
NEWEST = {Engine.VLLM: (0, 33, 0), Engine.SGLANG: (0, 5, 23)}
# Oldest release the model claims to cover (Qwen3.5 support arrived in Feb 2026).
OLDEST = {Engine.VLLM: (0, 16, 0), Engine.SGLANG: (0, 5, 9)}

_SPEC = re.compile(r"^(vllm|sglang)(?:@(\d+(?:\.\d+){0,2}))?$")


def parse_version(spec: str | EngineVersion, engine: Engine | None = None) -> EngineVersion:
    """``"vllm@0.17"`` -> EngineVersion('vllm', (0, 17, 0)); ``"vllm"`` -> newest; bare ``"0.17"`` with
    ``engine`` given. Versions outside [OLDEST, NEWEST] are refused (the model says nothing there)."""
    if isinstance(spec, EngineVersion):
        return spec
    text = spec.strip().lower()
    if engine is not None and not text.startswith(engine.value):
        text = f"{engine.value}@{text}"
    m = _SPEC.match(text)
    if not m:
        raise UsageError(
            f"bad engine version spec {spec!r}",
            expected="vllm@X.Y[.Z] or sglang@X.Y.Z",
            got=spec,
            hint='e.g. "vllm@0.17" or "sglang@0.5.23"; a bare engine name means its newest modelled release',
        )
    eng = Engine(m.group(1))
    if engine is not None and eng is not engine:
        raise UsageError(
            f"version spec {spec!r} is for {eng.value}, not {engine.value}",
            got=spec,
            hint=f"give a {engine.value} release, e.g. {engine.value}@{'.'.join(map(str, NEWEST[engine]))}",
        )
    if m.group(2) is None:
        release = NEWEST[eng]
    else:
        parts = tuple(int(p) for p in m.group(2).split("."))
        release = parts + (0,) * (3 - len(parts))
    if not OLDEST[eng] <= release <= NEWEST[eng]:
        newest = ".".join(map(str, NEWEST[eng]))
        raise UsageError(
            f"{eng.value} {'.'.join(map(str, release))} is outside the modelled range",
            expected=f"{'.'.join(map(str, OLDEST[eng]))} .. {newest}",
            got=spec,
            hint=f"give a release in that range (`{eng.value}` alone means {eng.value}@{newest}); what a newer "
            "release does is not modelled yet",
        )
    return EngineVersion(eng.value, release)


def parse_flavour(flavour: str | Flavour) -> Flavour:
    if isinstance(flavour, Flavour):
        return flavour
    f = flavour.strip().lower()
    if f.startswith("modelopt"):
        return Flavour.MODELOPT
    return Flavour(f)


class PartialFusedExclusion(QtoolError):
    """An engine refuses the ignore list: some but not all shards of a fused module are excluded.

    vLLM (quant_utils.is_layer_skipped / compressed_tensors should_ignore_layer) and SGLang
    (quantization/utils.is_layer_skipped, compressed_tensors/utils.should_ignore_layer) raise
    ValueError("Detected some but not all shards of ... are quantized") at model construction.
    """


# ---------------------------------------------------------------------------------------------
# Qwen3.5-MoE module structure shared by both engines
# ---------------------------------------------------------------------------------------------

# Checkpoint shards -> the fused runtime Linear both engines build (vLLM qwen3_5.py
# packed_modules_mapping = Qwen3VL's | {in_proj_qkvz, in_proj_ba}; SGLang qwen3_5.py
# Qwen3_5ForCausalLM.packed_modules_mapping, same four entries).
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_SHARD_TO_FUSED = {s: f for f, shards in PACKED_MODULES.items() for s in shards}

_EXPERT = re.compile(r"^(?P<moe>.*\.mlp\.experts)(?:\.\d+\.(?:gate|up|down)_proj|\.gate_up_proj|\.down_proj)$")


@dataclass(frozen=True)
class Unit:
    """The runtime module an HF module belongs to, in HF naming (engines then rename the prefix)."""

    name: str  # e.g. model.language_model.layers.3.self_attn.qkv_proj, ...layers.0.mlp.experts
    kind: str  # "linear" | "moe" | "router" | "shared_expert_gate" | "mtp_fc" | "lm_head" | "vision"
    shards: tuple[str, ...] = ()  # HF shard module names when fused (empty otherwise)


def unit_of(hf_module: str) -> Unit:
    """Map an HF checkpoint module name to the runtime unit an engine builds for it."""
    name = hf_module.removesuffix(".weight")
    m = _EXPERT.match(name)
    if m:
        return Unit(m.group("moe"), "moe")
    if name == "lm_head":
        return Unit(name, "lm_head")
    if name.startswith("model.visual."):
        # vision attn.qkv is already packed (packed mapping "qkv": ["qkv"]); no fusion to model
        return Unit(name, "vision")
    if name == "mtp.fc":
        return Unit(name, "mtp_fc")
    if name.endswith(".mlp.gate"):
        return Unit(name, "router")
    if name.endswith(".mlp.shared_expert_gate"):
        return Unit(name, "shared_expert_gate")
    parent, _, leaf = name.rpartition(".")
    fused = _SHARD_TO_FUSED.get(leaf)
    if fused is not None and not (leaf in ("gate_proj", "up_proj") and ".experts." in name):
        shards = tuple(f"{parent}.{s}" for s in PACKED_MODULES[fused])
        return Unit(f"{parent}.{fused}", "linear", shards)
    return Unit(name, "linear")


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")
