"""compact_ignore_patterns round trips on a realistic 60-layer module list, verified by engine_decisions."""

from __future__ import annotations

import pytest

from qtool.engines import compact_ignore_patterns, engine_decisions
from qtool.errors import QtoolError

from .qwen35_modules import flatten, model_modules


def _split(groups, unquantized):
    unq, q = [], []
    for g, parts in groups.items():
        for part, ms in parts.items():
            (unq if unquantized(g, part) else q).extend(ms)
    return unq, q


def _check(unq, q, flavour):
    pats = compact_ignore_patterns(unq, q, flavour)
    dec = engine_decisions(unq + q, pats, flavour)
    for eng, row in dec.items():
        wrong = [m for m in unq if row[m] is not True] + [m for m in q if row[m] is not False]
        assert not wrong, (eng, pats, wrong[:5])
    return pats


def _nvidia(g, part):  # routed experts (and shared expert) NVFP4, the rest BF16
    return not (g.startswith("layer.") and part in ("experts", "shared_expert"))


def _hybrid(g, part):  # + BF16 shared experts and layer-0 routed experts
    return _nvidia(g, part) or part == "shared_expert" or (g == "layer.0" and part == "experts")


@pytest.mark.parametrize("flavour", ["modelopt", "compressed-tensors"])
def test_nvidia_split(flavour):
    groups = model_modules()
    pats = _check(*_split(groups, _nvidia), flavour)
    assert len(pats) <= 8, pats


def test_hybrid_split_modelopt_is_compact():
    pats = _check(*_split(model_modules(), _hybrid), "modelopt")
    assert "*.mlp.shared_expert.*" in pats
    assert "lm_head" in pats and "model.visual*" in pats and "mtp*" in pats
    assert any("layers.0." in p for p in pats)  # whole layer 0 is BF16 here
    assert len(pats) <= 10, pats


def test_hybrid_split_compressed_tensors():
    pats = _check(*_split(model_modules(), _hybrid), "compressed-tensors")
    assert all(p.startswith("re:") or p == "lm_head" for p in pats), pats


def test_layer_1_only_not_10_11():
    groups = model_modules()
    unq, q = _split(groups, lambda g, p: _nvidia(g, p) or (g == "layer.1" and p == "experts"))
    pats = _check(unq, q, "modelopt")
    assert "*.layers.1*" not in pats  # would reach layers 10-19 in SGLang


def test_quantized_mtp_needs_mtp_safe_layer0_patterns():
    # MTP head quantized like the main model: `*.layers.0.mlp.experts*` would also hit mtp.layers.0
    groups = model_modules()

    def unq(g, p):
        if g == "mtp":
            return p in ("router", "shared_expert_gate", "fc", "attn")
        return _nvidia(g, p) or (g == "layer.0" and p == "experts")

    u, q = _split(groups, unq)
    pats = _check(u, q, "compressed-tensors")
    assert pats
    # modelopt: SGLang builds the whole MTP head BF16 for serialized modelopt_fp4 -> quantized MTP
    # experts cannot be expressed; the generator must say so rather than return a wrong list
    with pytest.raises(QtoolError):
        compact_ignore_patterns(u, q, "modelopt")


def test_mixed_fused_unit_is_refused():
    L = "model.language_model.layers.3.self_attn"
    with pytest.raises(QtoolError):
        compact_ignore_patterns([f"{L}.q_proj"], [f"{L}.k_proj", f"{L}.v_proj"], "modelopt")


def test_engine_decisions_reports_partial_as_none():
    L = "model.language_model.layers.3.self_attn"
    dec = engine_decisions([f"{L}.k_proj"], [f"{L}.q_proj"], "modelopt", versions=["vllm", "sglang"])
    assert dec == {"vllm@0.33.0": {f"{L}.k_proj": None}, "sglang@0.5.23": {f"{L}.k_proj": None}}


def test_everything_listed_small():
    groups = model_modules(n_layers=8)
    assert flatten(groups)


def test_unit_decider_answers_as_each_module_asked():
    """The pattern search's per-unit shortcut (UnitDecider) decides as the engines' per-module functions."""
    from qtool.engines import parse_flavour, unit_of
    from qtool.engines.patterns import UnitDecider

    unq, q = _split(model_modules(), _hybrid)
    mods = unq + q
    reps: dict[str, str] = {}
    for m in mods:
        reps.setdefault(unit_of(m).name, m)
    for flavour, lists in (
        ("modelopt", [[], ["*.mlp.shared_expert.*", "lm_head"], ["*.layers.0.*"]]),
        ("compressed-tensors", [[], [r"re:.*\.layers\.0\.", "lm_head"]]),
    ):
        dec = UnitDecider(parse_flavour(flavour), reps)
        for ign in lists:
            by_module = engine_decisions(mods, ign, flavour)
            got = dec.excluded(ign)
            assert got is not None
            for row, units in zip(by_module.values(), got, strict=True):
                assert units == {unit_of(m).name for m in mods if row[m]}, (flavour, ign)
        # some but not all shards of a fused module: refused, as each module's decision is
        partial = [m for m in mods if m.endswith("layers.3.self_attn.q_proj")]
        if flavour == "modelopt" and partial:
            assert dec.excluded(partial) is None
            assert None in engine_decisions(mods, partial, flavour)["vllm@0.33.0"].values()
