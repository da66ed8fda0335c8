"""Expert coverage (qtool.ops.quantize.coverage): experts that the router sends no token or only a few, under
every coding method, give finite scales and weights and are coded by the recorded fallback rule; a recipe's
`calibration.experts: all` gives every expert every calibration token while the hidden states handed to
the next layer stay those of the model's own routing; `--resume` of such a run gives the same bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from qtool.cli.main import main
from qtool.errors import UsageError
from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_tensor
from qtool.recipes import (
    Backend,
    ExpertCoverage,
    ExpertTokens,
    InputScale,
    NVFP4Options,
    WeightScale,
    load_recipe,
)
from qtool.stream.layer_stream import LayerStreamer

STARVED = [6, 7]  # the router never sends them a token
FEW = 5  # the router sends it the first FEW_ROWS tokens of each micro-batch only
FEW_ROWS = 3
FLOOR = 8  # min_expert_tokens: above FEW_ROWS (one micro-batch a layer here)


def _forced_router(monkeypatch) -> None:
    """transformers' Qwen3_5MoeTopKRouter.forward with experts STARVED masked out of every token's choice
    and expert FEW forced into the first FEW_ROWS tokens' (out of the others'): the routing a checkpoint
    whose router ignores some experts gives."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight).float()
        logits[:, STARVED + [FEW]] = float("-inf")
        logits[:FEW_ROWS, FEW] = logits[:FEW_ROWS].amax(dim=-1) + 10.0
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        top = (top / top.sum(dim=-1, keepdim=True)).to(self.weight.dtype)
        return logits.to(self.weight.dtype), top, idx

    monkeypatch.setattr(hf_moe.Qwen3_5MoeTopKRouter, "forward", forward)


def _tensors(root) -> dict[str, torch.Tensor]:
    return {n: read_tensor(i) for n, i in Checkpoint.open(root).tensors.items()}


def _not_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors (FP8 scales and weights included) holding a NaN or an inf."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t.float()).all()]


def _with_floor(recipe, **changes):
    return dataclasses.replace(recipe, expert_coverage=ExpertCoverage(min_tokens=FLOOR), **changes)


NVFP4 = load_recipe("qwen35-nvfp4-experts")
INT4 = load_recipe("qwen35-awq-int4")
METHODS = {
    **{
        f"nvfp4-{ws.value}": _with_floor(NVFP4, nvfp4=NVFP4Options(ws, InputScale.PER_EXPERT))
        for ws in (WeightScale.MAX, WeightScale.MSE, WeightScale.MSE_SWEEP, WeightScale.FOUR_OVER_SIX)
    },
    "w4a16-rtn": _with_floor(INT4, int4=dataclasses.replace(INT4.int4, awq=False)),
    "w4a16-awq": _with_floor(INT4),
    "nvfp4-v2-fp8-rest": _with_floor(load_recipe("qwen35-nvfp4-v2")),
}


@pytest.fixture(scope="module")
def starved_runs(tiny_bf16, calib_ids, tmp_path_factory):
    """Every method's quantize of the tiny model under the forced routing: name -> (output, report)."""
    from qtool.ops.quantize import run

    with pytest.MonkeyPatch.context() as monkeypatch:
        _forced_router(monkeypatch)
        root = tmp_path_factory.mktemp("starved")
        return {
            name: (root / name, run(tiny_bf16, out=root / name, recipe=recipe, calib_ids=calib_ids[:8]))
            for name, recipe in METHODS.items()
        }


@pytest.mark.parametrize("method", sorted(METHODS))
def test_starved_and_rare_experts_are_finite_and_fall_back(starved_runs, method):
    out, rep = starved_runs[method]
    assert rep["output"]["problems"] == []
    assert _not_finite(_tensors(out)) == []
    coded = [entry for entry in rep["layers"] if entry["routed_experts"] != "bf16"]
    assert coded
    for entry in coded:
        tokens = entry["tokens_per_expert"]
        assert [tokens[e] for e in STARVED] == [0, 0] and 0 < tokens[FEW] < FLOOR
        # the decision is the floor's, exactly, and it is recorded with its rule
        assert entry["experts_fallback"] == [e for e, t in enumerate(tokens) if t < FLOOR]
        assert {FEW, *STARVED} <= set(entry["experts_fallback"])
        assert (entry["min_expert_tokens"], entry["fallback_rule"], entry["expert_tokens"]) == (
            FLOOR,
            "layer_amax",
            "natural",
        )
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert [e["experts_fallback"] for e in man["layers"]] == [e["experts_fallback"] for e in rep["layers"]]


@pytest.mark.parametrize("method", [m for m in sorted(METHODS) if m.startswith("nvfp4-") and "v2" not in m])
def test_nvfp4_experts_below_the_floor_take_the_layers_input_amax(starved_runs, method):
    """per_expert input scales: an expert under the floor gets the layer's largest (its own few tokens'
    amax would clip the activations it meets when served)."""
    out, rep = starved_runs[method]
    t = _tensors(out)
    for entry in rep["layers"]:
        prefix = f"model.language_model.layers.{entry['layer']}.mlp.experts."
        for proj in ("gate_proj", "down_proj"):
            scales = {e: t[f"{prefix}{e}.{proj}.input_scale"].item() for e in range(8)}
            layer_max = max(scales.values())
            assert all(scales[e] == layer_max for e in entry["experts_fallback"]), (entry["layer"], proj)


def test_awq_experts_below_the_floor_are_plain_rtn(starved_runs):
    """AWQ searches no scale for an expert under the floor: its bytes are those of RTN."""
    awq_out, rep = starved_runs["w4a16-awq"]
    awq, rtn = _tensors(awq_out), _tensors(starved_runs["w4a16-rtn"][0])
    compared = 0
    for entry in rep["layers"]:
        for e in entry["experts_fallback"]:
            prefix = f"model.language_model.layers.{entry['layer']}.mlp.experts.{e}."
            names = [n for n in awq if n.startswith(prefix)]
            assert names and all(torch.equal(awq[n], rtn[n]) for n in names), prefix
            compared += len(names)
    assert compared


def test_report_shows_the_experts_that_fell_back(starved_runs, tmp_path, capsys):
    out, rep = starved_runs["nvfp4-max"]
    page = tmp_path / "r.html"
    assert main(["report", str(out), "--tp", "1", "-o", str(page)]) == 0
    capsys.readouterr()
    html = page.read_text(encoding="utf-8")
    for entry in rep["layers"]:
        fell = ",".join(map(str, entry["experts_fallback"]))
        assert f'data-fallback="{fell}"' in html
    assert "layer_amax" in html and "min_expert_tokens" in html


def _capture_layer_outputs(monkeypatch) -> list[torch.Tensor]:
    """The hidden states each layer's forward hands to the next one, in order (LayerStreamer.forward_layer's
    writes into the store)."""
    seen: list[torch.Tensor] = []
    real = LayerStreamer.forward_layer

    def forward_layer(self, layer, store, *a, **k):
        write = store.write

        def spy(b0, b1, y):
            seen.append(y.detach().clone())
            return write(b0, b1, y)

        store.write = spy
        try:
            return real(self, layer, store, *a, **k)
        finally:
            del store.write

    monkeypatch.setattr(LayerStreamer, "forward_layer", forward_layer)
    return seen


def _all_tokens(recipe):
    return dataclasses.replace(recipe, expert_coverage=ExpertCoverage(ExpertTokens.ALL))


def test_all_gives_every_expert_every_token_and_leaves_the_layer_outputs_unchanged(
    tiny_bf16, calib_ids, tmp_path, monkeypatch
):
    from qtool.ops.quantize import run

    ids = calib_ids[:8]
    per_expert = dataclasses.replace(NVFP4, nvfp4=NVFP4Options(input_scale=InputScale.PER_EXPERT))
    outputs = {}
    reports = {}
    for name, recipe in (("natural", per_expert), ("all", _all_tokens(per_expert))):
        with monkeypatch.context() as m:
            seen = _capture_layer_outputs(m)
            reports[name] = run(tiny_bf16, out=tmp_path / name, recipe=recipe, calib_ids=ids)
        outputs[name] = seen
    assert len(outputs["all"]) == len(outputs["natural"]) >= 8
    assert all(torch.equal(a, b) for a, b in zip(outputs["all"], outputs["natural"], strict=True))
    for entry in reports["all"]["layers"]:
        assert entry["tokens_per_expert"] == [ids.numel()] * 8
        assert (entry["expert_tokens"], entry["experts_fallback"]) == ("all", [])
    assert any(
        0 in e["tokens_per_expert"] or len(set(e["tokens_per_expert"])) > 1 for e in reports["natural"]["layers"]
    )
    # every expert saw the same input: its own gate/up input amax is the layer's
    t = _tensors(tmp_path / "all")
    for entry in reports["all"]["layers"]:
        prefix = f"model.language_model.layers.{entry['layer']}.mlp.experts."
        assert len({t[f"{prefix}{e}.gate_proj.input_scale"].item() for e in range(8)}) == 1


def test_all_resumes_to_the_same_bytes(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """AWQ with every token: stopped during layer 4 and resumed, the output is the uninterrupted run's."""
    from qtool.ops.quantize import layer as layer_mod
    from qtool.ops.quantize import run

    recipe, ids = _all_tokens(INT4), calib_ids[:8]
    whole = tmp_path / "whole"
    run(tiny_bf16, out=whole, recipe=recipe, calib_ids=ids)
    real = layer_mod.write_layer_shard

    def stop_at_layer_4(path, layer_plan, *a, **k):
        if layer_plan.index == 4:
            raise KeyboardInterrupt
        return real(path, layer_plan, *a, **k)

    out = tmp_path / "r"
    monkeypatch.setattr(layer_mod, "write_layer_shard", stop_at_layer_4)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_bf16, out=out, recipe=recipe, calib_ids=ids)
    monkeypatch.setattr(layer_mod, "write_layer_shard", real)
    rep = run(tiny_bf16, out=out, recipe=recipe, calib_ids=ids, resume=True)
    assert rep["resumed_from_layer"] == 4
    a, b = _tensors(out), _tensors(whole)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    manifests = [json.loads((d / "qtool-manifest.json").read_text())["layers"] for d in (out, whole)]
    assert manifests[0] == manifests[1]


def test_all_with_a_peer_backend_is_a_usage_error(tiny_bf16, tmp_path):
    from qtool.ops.quantize.plan import QuantizeOptions, plan

    opts = QuantizeOptions(tiny_bf16, tmp_path / "o", _all_tokens(NVFP4), backend=Backend.LLMCOMPRESSOR)
    with pytest.raises(UsageError, match="experts: all"):
        plan(opts)


def test_a_floor_above_the_runs_tokens_per_expert_is_a_plan_note(tiny_bf16, calib_ids, tmp_path):
    from qtool.ops.quantize.plan import QuantizeOptions, plan

    ids = calib_ids[:2]  # 64 tokens, top 2 of 8 experts: 16 an expert on average
    high = dataclasses.replace(NVFP4, expert_coverage=ExpertCoverage(min_tokens=40))
    notes = plan(QuantizeOptions(tiny_bf16, tmp_path / "o", high, calib_ids=ids)).warnings
    assert any("min_expert_tokens 40 is above the 16 tokens" in w for w in notes)
    every = dataclasses.replace(high, expert_coverage=ExpertCoverage(ExpertTokens.ALL, 40))  # 64 each
    assert not any(
        "min_expert_tokens" in w
        for w in plan(QuantizeOptions(tiny_bf16, tmp_path / "o", every, calib_ids=ids)).warnings
    )
