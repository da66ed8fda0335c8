"""Every shipped recipe loads and plans on the tiny model; malformed recipes are rejected."""

from __future__ import annotations

import pytest

from qtool.recipes import RecipeError, Scheme, list_recipes, load_recipe, parse_recipe


def test_ships_the_recipes():
    assert {
        "qwen35-nvfp4-experts",
        "qwen35-nvfp4-experts-mse",
        "qwen35-nvfp4-experts-gptq",
        "qwen35-awq-int4",
        "qwen35-nvfp4-v2",
    } <= set(list_recipes())


def test_the_gptq_recipe_is_the_best_measured_combination():
    """GPTQ with local_hessian block scales chosen as it goes (0.737x max's KLD on the proxy: docs/_quality.md)."""
    from qtool.recipes import GptqScales, WeightScale

    r = load_recipe("qwen35-nvfp4-experts-gptq")
    assert r.quantized_scheme is Scheme.NVFP4 and r.nvfp4.weight_scale is WeightScale.LOCAL_HESSIAN
    assert r.gptq.enabled and r.gptq.scales is GptqScales.UPDATED and not r.gptq.act_order


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_plans(name, tiny_bf16, tmp_path):
    from qtool.ops.quantize import QuantizeOptions, plan

    r = load_recipe(name)
    p = plan(QuantizeOptions(tiny_bf16, tmp_path / "o", r, samples=4, seq_len=256))  # what the builtin corpus gives
    assert len(p.layers) == 8 and p.to_json()["memory"]["need"]["host_bytes_per_rank"] > 0
    assert {lp.scheme for lp in p.layers} - {Scheme.BF16} == {r.quantized_scheme}
    if name == "qwen35-awq-int4":
        assert p.layers[0].scheme is Scheme.BF16


def test_mse_recipe_not_worse_than_rtn_per_block():
    import torch

    from qtool.formats import nvfp4
    from qtool.ops.quantize.nvfp4_mse import search_block_scales

    w = torch.randn(64, 256)
    ws2 = nvfp4.weight_scale_2_from_amax(nvfp4.matrix_amax(w))
    rtn = nvfp4.quantize(w, weight_scale_2=ws2).dequantize(torch.float32)
    mse = nvfp4.quantize(w, weight_scale_2=ws2, block_scale=search_block_scales(w, ws2)).dequantize(torch.float32)
    e_rtn, e_mse = (rtn - w).pow(2).sum(), (mse - w).pow(2).sum()
    assert e_mse < e_rtn


@pytest.mark.parametrize(
    "bad,msg",
    [
        ({"schema_version": 2, "name": "x"}, "schema_version"),
        ({"schema_version": 1, "name": "x", "groups": {"shared_expert": "nvfp4"}}, "not supported"),
        ({"schema_version": 1, "name": "x", "groups": {"routed_experts": "fp3"}}, "unknown value"),
        (
            {
                "schema_version": 1,
                "name": "x",
                "groups": {"routed_experts": "w4a16"},
                "defaults": {"format": "modelopt"},
            },
            "cannot hold",
        ),
        ({"schema_version": 1, "name": "x", "bogus": 1}, "unknown recipe keys"),
        # mixed recipes: fp8 only where the engines load it, with nvfp4 experts, in a format that holds both
        ({"schema_version": 1, "name": "x", "groups": {"router": "fp8"}}, "not supported"),
        ({"schema_version": 1, "name": "x", "groups": {"mtp": "fp8"}}, "not supported"),
        ({"schema_version": 1, "name": "x", "groups": {"routed_experts": "fp8"}}, "not supported"),
        (
            {"schema_version": 1, "name": "x", "groups": {"routed_experts": "w4a16", "attention": "fp8"}},
            "cannot be mixed with fp8",
        ),
        (
            {
                "schema_version": 1,
                "name": "x",
                "groups": {"attention": "fp8"},
                "defaults": {"format": "awq"},
            },
            "cannot hold fp8",
        ),
        ({"schema_version": 1, "name": "x", "int4": {"group_size": 100}}, "group_size"),
        # expert coverage: a closed set of policies, a floor of at least one token, no stray keys
        ({"schema_version": 1, "name": "x", "calibration": {"experts": "most"}}, "calibration.experts"),
        ({"schema_version": 1, "name": "x", "calibration": {"min_expert_tokens": 0}}, "min_expert_tokens"),
        ({"schema_version": 1, "name": "x", "calibration": {"min_expert_tokens": True}}, "min_expert_tokens"),
        ({"schema_version": 1, "name": "x", "calibration": {"experts": "all", "floor": 4}}, "unknown calibration keys"),
        ({"schema_version": 1, "name": "x", "calibration": {"experts": "all", "samples": 4}}, "calibration needs"),
    ],
)
def test_bad_recipes_rejected(bad, msg):
    with pytest.raises(RecipeError, match=msg):
        parse_recipe(bad)


def test_expert_coverage_options_sit_beside_the_calibration_data():
    from qtool.recipes import ExpertCoverage, ExpertTokens

    data = {"dataset": "hf:org/name", "samples": 16, "seq_len": 2048}
    r = parse_recipe(
        {"schema_version": 1, "name": "x", "calibration": {**data, "experts": "all", "min_expert_tokens": 16}}
    )
    assert r.calibration == data and r.expert_coverage == ExpertCoverage(ExpertTokens.ALL, 16)
    assert r.to_json()["expert_coverage"] == {"experts": "all", "min_expert_tokens": 16}
    alone = parse_recipe({"schema_version": 1, "name": "x", "calibration": {"experts": "all"}})
    assert alone.calibration is None and alone.expert_coverage.experts is ExpertTokens.ALL
    # the default is the rule qtool always had: only an expert that saw no token falls back
    assert load_recipe("qwen35-nvfp4-experts").expert_coverage == ExpertCoverage(ExpertTokens.NATURAL, 1)


def test_shipped_recipes_say_what_they_calibrate_on(tiny_bf16, tmp_path):
    """Recipes name the real dataset and token budget they are meant for; a run on less (the builtin corpus,
    for the demo and offline use) plans with a warning saying so."""
    from qtool.ops.quantize import QuantizeOptions, plan

    for name in ("qwen35-nvfp4-experts", "qwen35-nvfp4-experts-mse", "qwen35-nvfp4-experts-gptq", "qwen35-awq-int4"):
        r = load_recipe(name)
        assert (
            r.calibration["dataset"].startswith("hf:") and r.calibration["samples"] * r.calibration["seq_len"] >= 32768
        )
    p = plan(QuantizeOptions(tiny_bf16, tmp_path / "o", load_recipe("qwen35-nvfp4-experts"), samples=4, seq_len=256))
    assert any("meant to calibrate on hf:HuggingFaceH4/ultrachat_200k" in w for w in p.warnings)


def test_mixed_recipe_and_its_fix_line():
    """nvidia's V2 mix loads; an unloadable mix names the fix."""
    r = load_recipe("qwen35-nvfp4-v2")
    assert r.is_mixed and r.schemes == {Scheme.NVFP4, Scheme.FP8} and r.quantized_scheme is Scheme.NVFP4
    assert r.nvfp4.weight_scale.value == "mse_sweep" and r.kv_cache.value == "fp8"
    bad = {"schema_version": 1, "name": "x", "groups": {"routed_experts": "w4a16", "shared_expert": "fp8"}}
    with pytest.raises(RecipeError) as e:
        parse_recipe(bad)
    assert "nvfp4" in e.value.hint
