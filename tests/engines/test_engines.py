"""Hand-made cases for each modelled engine rule (see qtool/engines/vllm.py, sglang.py)."""

from __future__ import annotations

import pytest

from qtool.engines import PartialFusedExclusion, parse_version, sglang, unit_of, vllm
from qtool.errors import QtoolError

L = "model.language_model.layers"

# nvidia/Qwen3.5-397B-A17B-NVFP4 style (hf_quant_config exclude_modules), plus the hybrid additions
NVIDIA_IGNORE = (
    ["lm_head", "model.visual*", "mtp.layers.0*"]
    + [f"{L}.{i}.{'self_attn' if (i + 1) % 4 == 0 else 'linear_attn'}*" for i in range(60)]
    + ["model.language_model.layers..mlp.gate", "mtp.fc"]
)
HYBRID = NVIDIA_IGNORE + ["*.mlp.shared_expert.*", "*.layers.0.mlp.experts*"]


def test_version_spec():
    assert parse_version("vllm@0.17").release == (0, 17, 0)
    assert parse_version("vllm").release == (0, 33, 0)
    assert parse_version("sglang@0.5.23").release == (0, 5, 23)
    with pytest.raises(QtoolError):
        parse_version("vllm@0.9")
    with pytest.raises(QtoolError):
        parse_version("tgi@1.0")


def test_units():
    assert unit_of(f"{L}.3.self_attn.k_proj").name == f"{L}.3.self_attn.qkv_proj"
    assert unit_of(f"{L}.0.linear_attn.in_proj_z").name == f"{L}.0.linear_attn.in_proj_qkvz"
    assert unit_of(f"{L}.0.linear_attn.in_proj_a").name == f"{L}.0.linear_attn.in_proj_ba"
    assert unit_of(f"{L}.0.mlp.experts.511.down_proj").name == f"{L}.0.mlp.experts"
    assert unit_of(f"{L}.0.mlp.shared_expert.up_proj").name == f"{L}.0.mlp.shared_expert.gate_up_proj"
    assert unit_of(f"{L}.0.mlp.gate").kind == "router"


def test_vllm_name_mapping():
    assert vllm.runtime_name(f"{L}.3.self_attn.q_proj") == "language_model.model.layers.3.self_attn.qkv_proj"
    assert vllm.runtime_name("model.visual.blocks.0.attn.qkv") == "visual.blocks.0.attn.qkv"
    assert vllm.runtime_name("lm_head") == "language_model.lm_head"
    assert vllm.runtime_name("mtp.layers.0.mlp.experts.1.up_proj") == "mtp.layers.0.mlp.experts"
    # `x*` splits into `x`, `x.*` before mapping (PR 30164)
    assert vllm.mapped_ignore(["model.visual*", "*.mlp.shared_expert.*"], vllm.Flavour.MODELOPT) == [
        "model.visual",
        "visual.*",
        "*.mlp.shared_expert.*",
    ]


@pytest.mark.parametrize("eng", [vllm, sglang])
def test_nvidia_style_list(eng):
    ex = lambda m: eng.is_excluded(m, NVIDIA_IGNORE)  # noqa: E731
    assert ex("lm_head")
    assert ex(f"{L}.3.self_attn.o_proj") and ex(f"{L}.3.self_attn.q_proj")
    assert ex(f"{L}.0.linear_attn.in_proj_qkv") and ex(f"{L}.0.linear_attn.out_proj")
    assert not ex(f"{L}.0.mlp.experts.0.gate_proj")
    assert not ex(f"{L}.0.mlp.shared_expert.down_proj")
    assert ex("model.visual.blocks.0.mlp.linear_fc2")
    assert ex("mtp.layers.0.mlp.experts.0.up_proj") and ex("mtp.fc")


@pytest.mark.parametrize("eng", [vllm, sglang])
def test_hybrid_shared_expert_and_layer0(eng):
    ex = lambda m: eng.is_excluded(m, HYBRID)  # noqa: E731
    assert ex(f"{L}.7.mlp.shared_expert.gate_proj") and ex(f"{L}.7.mlp.shared_expert.down_proj")
    assert ex(f"{L}.0.mlp.experts.5.down_proj")
    assert not ex(f"{L}.1.mlp.experts.5.down_proj")
    assert not ex(f"{L}.10.mlp.experts.5.down_proj")


def test_shared_expert_glob_spares_shared_expert_gate_in_old_vllm():
    assert not vllm.is_excluded(f"{L}.0.mlp.shared_expert_gate", ["*.mlp.shared_expert.*"], version="vllm@0.16")


def test_double_dot_gate_entry_matches_nothing():
    # the field report's "model.language_model.layers..mlp.gate" is not a substring/glob of any runtime name
    ign = ["model.language_model.layers..mlp.gate"]
    assert not vllm.is_excluded(f"{L}.0.mlp.gate", ign, version="vllm@0.16")
    assert not sglang.modelopt_is_layer_excluded("model.language_model.layers.0.mlp.gate", ign)


def test_router_hardcoded_by_version():
    assert not vllm.is_excluded(f"{L}.0.mlp.gate", [], version="vllm@0.16")
    assert vllm.is_excluded(f"{L}.0.mlp.gate", [], version="vllm@0.17")
    assert vllm.is_excluded(f"{L}.0.mlp.gate", ["*.mlp.gate"], version="vllm@0.16")
    assert not vllm.is_excluded(f"{L}.0.mlp.gate_up_proj", ["*.mlp.gate"], version="vllm@0.16")
    assert sglang.is_excluded(f"{L}.0.mlp.gate", [])


def test_mtp_fc_by_version_and_flavour():
    assert not vllm.is_excluded("mtp.fc", ["mtp.layers.0*"], version="vllm@0.18")
    assert vllm.is_excluded("mtp.fc", ["mtp.layers.0*"], version="vllm@0.19")
    assert not vllm.is_excluded("mtp.fc", [], version="vllm", quant_method="compressed-tensors")
    assert vllm.is_excluded("mtp.fc", ["mtp.fc"], version="vllm@0.16")
    assert sglang.is_excluded("mtp.fc", [])  # plain nn.Linear


def test_fused_shard_all_or_nothing():
    with pytest.raises(PartialFusedExclusion):
        vllm.is_excluded(f"{L}.3.self_attn.k_proj", [f"{L}.3.self_attn.q_proj"])
    with pytest.raises(PartialFusedExclusion):
        sglang.is_excluded(f"{L}.3.self_attn.k_proj", [f"{L}.3.self_attn.q_proj"])
    with pytest.raises(PartialFusedExclusion):
        vllm.is_excluded(f"{L}.0.linear_attn.in_proj_z", [f"{L}.0.linear_attn.in_proj_qkv"])
    both = [f"{L}.3.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert vllm.is_excluded(f"{L}.3.self_attn.v_proj", both)
    assert sglang.is_excluded(f"{L}.3.self_attn.v_proj", both)


def test_exact_expert_name_excludes_whole_moe_in_vllm_not_sglang():
    ign = [f"{L}.2.mlp.experts.0.gate_proj"]
    assert vllm.is_excluded(f"{L}.2.mlp.experts.9.up_proj", ign)
    assert not sglang.is_excluded(f"{L}.2.mlp.experts.9.up_proj", ign)


def test_layer_1_vs_10_11():
    # glob with the dot: only layer 1 in both engines
    for eng in (vllm, sglang):
        assert eng.is_excluded(f"{L}.1.mlp.experts.0.up_proj", ["*.layers.1.*"])
        assert not eng.is_excluded(f"{L}.10.mlp.experts.0.up_proj", ["*.layers.1.*"])
        assert not eng.is_excluded(f"{L}.11.mlp.experts.0.up_proj", ["*.layers.1.*"])
    # trailing `1*`: vLLM splits it into `.layers.1` + `.layers.1.*`, SGLang's regex reaches 10, 11
    assert not vllm.is_excluded(f"{L}.10.mlp.experts.0.up_proj", ["*.layers.1*"])
    assert sglang.is_excluded(f"{L}.10.mlp.experts.0.up_proj", ["*.layers.1*"])
    # vLLM substring rule: a bare layer path also reaches layers 10..19
    assert vllm.is_excluded(f"{L}.11.self_attn.o_proj", [f"{L}.1"])


def test_sglang_prefix_by_version():
    m = f"{L}.4.mlp.experts.0.up_proj"
    assert sglang.runtime_name(m, "sglang@0.5.23") == "model.language_model.layers.4.mlp.experts"
    assert sglang.runtime_name(m, "sglang@0.5.9") == "model.layers.4.mlp.experts"
    ign = [f"{L}.4.mlp.experts*"]
    assert sglang.is_excluded(m, ign, version="sglang@0.5.23")
    assert not sglang.is_excluded(m, ign, version="sglang@0.5.9")
    assert sglang.is_excluded(m, ["*.layers.4.mlp.experts*"], version="sglang@0.5.9")


def test_sglang_mtp_and_vision_hardcoded():
    assert sglang.is_excluded("mtp.layers.0.mlp.experts.0.up_proj", [])
    assert not sglang.is_excluded("mtp.layers.0.mlp.experts.0.up_proj", [], quant_method="compressed-tensors")
    assert sglang.is_excluded("model.visual.blocks.0.mlp.linear_fc2", [])


def test_compressed_tensors_vllm():
    ct = dict(quant_method="compressed-tensors")
    # exact names go through the mapper, regexes do not
    assert vllm.is_excluded(f"{L}.0.mlp.shared_expert.down_proj", [f"{L}.0.mlp.shared_expert.down_proj"], **ct)
    assert not vllm.is_excluded(f"{L}.0.mlp.shared_expert.down_proj", [r"re:model\.language_model\..*"], **ct)
    assert vllm.is_excluded(f"{L}.0.mlp.shared_expert.down_proj", [r"re:.*mlp\.shared_expert\."], **ct)
    assert vllm.is_excluded("mtp.layers.0.self_attn.q_proj", ["re:^mtp.*"], **ct)
    assert not vllm.is_excluded(
        f"{L}.0.mlp.shared_expert_gate", [r"re:.*mlp\.shared_expert\."], **ct, version="vllm@0.16"
    )


def test_compressed_tensors_sglang_suffix_match():
    ct = dict(quant_method="compressed-tensors")
    assert sglang.is_excluded(f"{L}.3.self_attn.o_proj", ["self_attn.o_proj"], **ct)
    # never a parent-prefix match (llm-compressor writes parents into ignore)
    assert not sglang.is_excluded(f"{L}.0.mlp.shared_expert.down_proj", [f"{L}.0.mlp.shared_expert"], **ct)
