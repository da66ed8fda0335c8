"""SGLang's decision "is this module of a Qwen3.5-MoE checkpoint quantized?" as pure functions.

Read from the SGLang 0.5.23 wheel. Runtime prefixes for Qwen3_5MoeForConditionalGeneration
(models/qwen3_5.py, built by Qwen3VLForConditionalGeneration.__init__ in models/qwen3_vl.py, which
passes ``add_prefix("model.language_model", prefix)`` to the language model):
``model.language_model.layers.N.{self_attn.qkv_proj, self_attn.o_proj, linear_attn.in_proj_qkvz,
linear_attn.in_proj_ba, linear_attn.out_proj, mlp.experts, mlp.shared_expert.gate_up_proj,
mlp.shared_expert.down_proj}``, ``lm_head``. ``hf_to_sglang_mapper = None`` for this class, so the
ignore list is used as written. Earlier SGLang (early-2026 community guide) built ``model.layers.N``.
"""

from __future__ import annotations

import re
from functools import lru_cache

from qtool.engines.base import (
    Engine,
    EngineVersion,
    Flavour,
    PartialFusedExclusion,
    Unit,
    parse_flavour,
    parse_version,
    unit_of,
)

# Language-model prefix by release. 0.5.23: "model.language_model" (models/qwen3_vl.py). The
# community guide (voipmonitor/rtx6kpro, early 2026) reports "model.layers.X" for Qwen3.5; the exact
# release of the switch is not verified, so releases before 0.5.23 are modelled with the old prefix.
LM_PREFIX_SINCE = ((0, 5, 23), "model.language_model.")
LM_PREFIX_BEFORE = "model."

# models/qwen3_5.py Qwen3_5ForCausalLM.packed_modules_mapping, handed to the quant config by
# model_loader/weight_utils.py get_quant_config (hf_quant_config["packed_modules_mapping"]).
SGLANG_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
# modelopt_quant.py is_layer_excluded: MLA shard names matched inside fused names (not used by Qwen3.5)
_FUSED_TAILS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}

BEHAVIOUR_RELEASES = ((0, 5, 9), (0, 5, 23))


def lm_prefix(version: EngineVersion) -> str:
    since, prefix = LM_PREFIX_SINCE
    return prefix if version.at_least(since) else LM_PREFIX_BEFORE


def runtime_name(hf_module: str, version: str | EngineVersion = "sglang") -> str:
    return _runtime_of_unit(unit_of(hf_module).name, parse_version(version, Engine.SGLANG))


def _runtime_of_unit(unit_name: str, version: EngineVersion) -> str:
    if unit_name.startswith("model.language_model."):
        return lm_prefix(version) + unit_name.removeprefix("model.language_model.")
    # lm_head: add_prefix("lm_head", ""); vision: add_prefix("model.visual", ""); MTP: the drafter
    # Qwen3_5ForCausalLMMTP builds Qwen3_5ForCausalLM(prefix=add_prefix("mtp", "")) -> "mtp.layers.0..."
    return unit_name


def _glob_regex(pattern: str) -> re.Pattern[str]:
    # modelopt_quant.py _compile_exclusion_pattern: "." literal, "*" -> ".*", used with fullmatch
    return _compiled(pattern)


@lru_cache(maxsize=8192)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.replace(".", r"\.").replace("*", ".*"))


def modelopt_is_layer_excluded(prefix: str, exclude: list[str]) -> bool:
    """modelopt_quant.py ModelOptQuantConfig.is_layer_excluded (0.5.23)."""
    if not exclude:
        return False
    prefixes = [prefix]
    if prefix.startswith("language_model."):
        prefixes.append(prefix.removeprefix("language_model."))
    for pattern in exclude:
        rx = _glob_regex(pattern)
        for p in prefixes:
            if rx.fullmatch(p) or any(rx.fullmatch(part) for part in p.split(".")):
                return True
        tail = pattern.rsplit(".", 1)[-1]
        if tail in _FUSED_TAILS and any(tail in p.rsplit(".", 1)[-1] for p in prefixes):
            return True
    return False


def _module_path_match(ignored: str, prefix: str) -> bool:
    # quantization/utils.py _module_path_match: equality, dotted-prefix, or dotted-substring
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def is_layer_skipped(prefix: str, ignored: list[str]) -> bool:
    """quantization/utils.py is_layer_skipped(prefix, exclude_modules, packed_modules_mapping)."""
    proj = prefix.split(".")[-1]
    if proj in SGLANG_PACKED:
        shards = [prefix.replace(proj, s) for s in SGLANG_PACKED[proj]]
        hits = [any(_module_path_match(i, s) for i in ignored) for s in shards]
        if any(hits) and not all(hits):
            raise PartialFusedExclusion(
                f"SGLang: some but not all shards of {prefix} are excluded",
                tensor=prefix,
                expected="all or none of " + ", ".join(shards),
            )
        return all(hits)
    skipped = any(_module_path_match(i, prefix) for i in ignored)
    if "experts" in prefix:
        skipped = skipped or any(prefix in i for i in ignored if "experts" in i)
    return skipped


def _ct_match(name: str, targets: list[str]) -> bool:
    # compressed_tensors/utils.py check_equal_or_regex_match: "re:" -> re.match (start-anchored);
    # plain -> equal or a dotted suffix of the name (never a prefix)
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == name or name.endswith("." + t):
            return True
    return False


def ct_should_ignore_layer(prefix: str, ignore: list[str]) -> bool:
    """compressed_tensors/utils.py should_ignore_layer(fused_mapping=packed_modules_mapping)."""
    proj = prefix.split(".")[-1]
    if proj in SGLANG_PACKED and prefix not in ignore:
        shards = [prefix.replace(proj, s) for s in SGLANG_PACKED[proj]]
        hits = [_ct_match(s, ignore) for s in shards]
        if any(hits) and not all(hits):
            raise PartialFusedExclusion(
                f"SGLang: different quantization schemes for the shards of {prefix}", tensor=prefix
            )
        return all(hits)
    return _ct_match(prefix, ignore)


def _hardcoded(kind: str, unit_name: str, fl: Flavour) -> str | None:
    if kind in ("router", "shared_expert_gate"):
        # models/qwen2_moe.py Qwen2MoeSparseMoeBlock: gate = ReplicatedLinear(quant_config=None);
        # shared_expert_gate = torch.nn.Linear (or ReplicatedLinear quant_config=None on CPU AMX)
        return "router/shared_expert_gate built without quant_config (models/qwen2_moe.py)"
    if kind == "vision":
        # models/qwen3_vl.py: Qwen3VLMoeVisionModel(quant_config=None)
        return "vision tower built without quant_config (models/qwen3_vl.py)"
    if kind == "mtp_fc":
        # models/qwen3_5_mtp.py: self.fc = nn.Linear(...)
        return "mtp.fc is a plain nn.Linear (models/qwen3_5_mtp.py)"
    if unit_name.startswith("mtp.") and fl is Flavour.MODELOPT:
        # models/qwen3_5_mtp.py _mtp_quant_config: serialized modelopt_fp4 -> the whole MTP head BF16
        return "MTP head built with quant_config=None for serialized modelopt_fp4 (qwen3_5_mtp.py)"
    return None


def hardcoded_unquantized(hf_module: str, flavour: str | Flavour = "modelopt") -> str | None:
    u = unit_of(hf_module)
    return _hardcoded(u.kind, u.name, parse_flavour(flavour))


@lru_cache(maxsize=65536)
def _decide(unit_name: str, kind: str, ignore: tuple[str, ...], v: EngineVersion, fl: Flavour) -> bool:
    if _hardcoded(kind, unit_name, fl):
        return True
    prefix = _runtime_of_unit(unit_name, v)
    lst = list(ignore)
    if fl is Flavour.MODELOPT:
        if kind == "moe":  # FusedMoE: only is_layer_excluded (modelopt_quant.py _get_quant_method)
            return modelopt_is_layer_excluded(prefix, lst)
        # LinearBase / ParallelLMHead: is_layer_skipped(...) or is_layer_excluded(...)
        return is_layer_skipped(prefix, lst) or modelopt_is_layer_excluded(prefix, lst)
    return ct_should_ignore_layer(prefix, lst)


def is_excluded(
    hf_module_name: str,
    ignore: list[str],
    *,
    version: str | EngineVersion = "sglang",
    quant_method: str | Flavour = "modelopt",
) -> bool:
    """True when SGLang ``version`` loads ``hf_module_name`` unquantized (BF16) given ``ignore``.

    Raises PartialFusedExclusion where SGLang would refuse the list (mixed fused shards).
    """
    return unit_excluded(
        unit_of(hf_module_name), tuple(ignore), parse_version(version, Engine.SGLANG), parse_flavour(quant_method)
    )


def unit_excluded(unit: Unit, ignore: tuple[str, ...], version: EngineVersion, fl: Flavour) -> bool:
    """is_excluded for a unit already found (unit_of) and parsed arguments (see vllm.unit_excluded)."""
    return _decide(unit.name, unit.kind, ignore, version, fl)
