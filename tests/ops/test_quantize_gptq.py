"""`qtool quantize` with a recipe's `gptq:` mapping on the tiny fixtures: plain NVFP4 / compressed-tensors INT4
(the scales RTN writes, other codes), the same bytes on every run and after kill -9 + --resume (and with
several ranks: tests/dist/test_data_parallel.py), and RTN for an expert without tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qtool.errors import UsageError
from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_tensor
from qtool.recipes import RecipeError, load_recipe, parse_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))

from in_process import run_cli
from killpoint import run_killed
from test_output_contract import tree_sha

NVFP4 = "groups: {routed_experts: nvfp4}\nnvfp4: {weight_scale: WS}\nkv_cache: none\n"
INT4 = "groups: {routed_experts: w4a16}\nint4: {group_size: 32, awq: AWQ}\nkv_cache: none\n"
GPTQ = "gptq: {enabled: true, block_size: 16}\n"
JOB = ["--samples", "2", "--seq-len", "16", "--quiet"]


def _recipe(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"schema_version: 1\nname: {name}\n{body}", encoding="utf-8")
    return path


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    ts = {n: read_tensor(i) for n, i in Checkpoint.open(root).tensors.items()}
    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for n, t in ts.items()}


def _quantize(src: Path, recipe: Path, out: Path, *extra: str) -> dict:
    """The run's report (--json)."""
    p = run_cli(["quantize", src, "-o", out, "--recipe", recipe, *JOB, "--json", *extra])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _codes_differ_scales_equal(gptq: dict, rtn: dict, codes: str) -> None:
    """Same tensors, same scales; the codes are GPTQ's own (not RTN's) in most layers."""
    assert gptq.keys() == rtn.keys()
    coded = [n for n in gptq if n.endswith(codes) and ".mlp.experts." in n and not n.startswith("mtp.")]
    for n, tensor in gptq.items():
        assert tensor.dtype == rtn[n].dtype and tensor.shape == rtn[n].shape, n
        if n not in coded:
            assert torch.equal(tensor, rtn[n]), n  # scales, copied tensors
    assert sum(not torch.equal(gptq[n], rtn[n]) for n in coded) > len(coded) // 2


@pytest.mark.parametrize("weight_scale", ["max", pytest.param("mse_sweep", marks=pytest.mark.slow)])
def test_nvfp4_gptq_writes_rtns_scales_and_its_own_codes_reproducibly(tiny_bf16, tmp_path, weight_scale):
    body = NVFP4.replace("WS", weight_scale)
    rtn, gptq = _recipe(tmp_path, "rtn", body), _recipe(tmp_path, "gptq", body + GPTQ)
    _quantize(tiny_bf16, rtn, tmp_path / "rtn")
    report = _quantize(tiny_bf16, gptq, tmp_path / "g1")
    _quantize(tiny_bf16, gptq, tmp_path / "g2")
    assert tree_sha(tmp_path / "g1") == tree_sha(tmp_path / "g2")
    _codes_differ_scales_equal(_tensors(tmp_path / "g1"), _tensors(tmp_path / "rtn"), ".weight")
    assert all(entry["gptq"]["rtn_experts"] == entry["experts_without_tokens"] for entry in report["layers"])


@pytest.mark.parametrize("awq", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_int4_gptq_writes_rtns_scales_and_its_own_codes(tiny_bf16, tmp_path, awq):
    body = INT4.replace("AWQ", str(awq).lower())
    _quantize(tiny_bf16, _recipe(tmp_path, "rtn", body), tmp_path / "rtn")
    _quantize(tiny_bf16, _recipe(tmp_path, "gptq", body + GPTQ), tmp_path / "g")
    _codes_differ_scales_equal(_tensors(tmp_path / "g"), _tensors(tmp_path / "rtn"), ".weight_packed")


@pytest.mark.slow
def test_gptq_resumed_after_kill_9_gives_the_same_bytes(tiny_bf16, tmp_path):
    recipe = _recipe(tmp_path, "gptq", NVFP4.replace("WS", "max") + GPTQ)
    _quantize(tiny_bf16, recipe, tmp_path / "ref")
    job = ["quantize", tiny_bf16, "-o", tmp_path / "out", "--recipe", recipe, *JOB]
    p = run_killed("qtool.ops.quantize.layer:write_layer_shard", 2, job)
    assert p.returncode == -9, p.stderr
    assert run_cli([*job, "--resume"]).returncode == 0
    assert tree_sha(tmp_path / "out") == tree_sha(tmp_path / "ref")


def test_gptq_with_a_peer_backend_is_refused(tiny_bf16, tmp_path):
    """(Several ranks are not: tests/dist/test_data_parallel.py gives them one process's bytes.)"""
    from qtool.ops.quantize import QuantizeOptions, plan

    recipe = load_recipe(_recipe(tmp_path, "gptq", NVFP4.replace("WS", "max") + GPTQ))
    with pytest.raises(UsageError, match="--backend modelopt does not run the recipe's gptq"):
        plan(QuantizeOptions(tiny_bf16, tmp_path / "a", recipe, backend="modelopt", samples=2, seq_len=16))


@pytest.mark.parametrize(
    ("gptq", "message"),
    [
        ("{enabled: yes-please}", "gptq.enabled must be true or false"),
        ("{enabled: true, damp: 0}", "gptq.damp must be a number in"),
        ("{enabled: true, block_size: 0}", "gptq.block_size must be a positive integer"),
        ("{enabled: true, order: 1}", "unknown gptq options"),
        ("{enabled: true, scales: later}", "unknown value for gptq.scales"),
    ],
)
def test_a_bad_gptq_mapping_is_refused(gptq, message):
    data = {"schema_version": 1, "name": "x", "groups": {"routed_experts": "nvfp4"}}
    import yaml

    with pytest.raises(RecipeError, match=message):
        parse_recipe({**data, "gptq": yaml.safe_load(gptq)})
    with pytest.raises(RecipeError, match="gptq codes the routed experts"):
        parse_recipe({**data, "groups": {"attention": "fp8"}, "gptq": {"enabled": True}})


@pytest.mark.parametrize(
    ("groups", "weight_scale", "gptq", "message"),
    [
        ("nvfp4", "local_hessian", {"enabled": True}, "local_hessian needs gptq.scales updated"),
        ("nvfp4", "mse", {"enabled": True, "scales": "updated"}, "cannot choose nvfp4.weight_scale mse"),
        ("nvfp4", "four_over_six", {"enabled": True, "scales": "updated"}, "cannot choose"),
        ("nvfp4", "max", {"enabled": True, "scales": "updated", "act_order": True}, "needs act_order false"),
        ("nvfp4", "max", {"enabled": True, "scales": "updated", "block_size": 24}, "multiple of 16"),
        ("nvfp4", "max", {"scales": "updated"}, "needs gptq enabled"),
        ("w4a16", "max", {"enabled": True, "scales": "updated"}, "needs gptq enabled and routed_experts nvfp4"),
    ],
)
def test_gptq_scales_updated_is_refused_where_it_cannot_run(groups, weight_scale, gptq, message):
    data = {"schema_version": 1, "name": "x", "groups": {"routed_experts": groups}, "gptq": gptq}
    with pytest.raises(RecipeError, match=message):
        parse_recipe({**data, "nvfp4": {"weight_scale": weight_scale}})


def test_gptq_scales_fixed_reports_as_before_and_updated_is_named():
    """A recipe that does not name gptq.scales reports the gptq options it always did (the bytes of a run's
    report and manifest do not change); `updated` is named."""
    base = {"schema_version": 1, "name": "x", "groups": {"routed_experts": "nvfp4"}}
    fixed = parse_recipe({**base, "gptq": {"enabled": True}}).gptq.to_json()
    assert fixed == {"enabled": True, "damp": 0.01, "block_size": 128, "act_order": False}
    updated = parse_recipe({**base, "gptq": {"enabled": True, "scales": "updated"}, "nvfp4": {"weight_scale": "max"}})
    assert updated.gptq.to_json()["scales"] == "updated"


@pytest.mark.slow
@pytest.mark.parametrize("weight_scale", ["local_hessian", "mse_sweep"])
def test_nvfp4_gptq_with_updated_scales_writes_plain_nvfp4_reproducibly(tiny_bf16, tmp_path, weight_scale):
    """gptq.scales updated: the same tensors, shapes and dtypes as RTN's NVFP4 (plain NVFP4: the max's global
    scale and input scales, E4M3 block scales, E2M1 codes), the block scales and codes its own, every weight
    finite, and the same bytes twice; the experts without tokens are named as GPTQ's RTN experts."""
    from qtool.formats import nvfp4

    body = NVFP4.replace("WS", weight_scale)
    updated = _recipe(tmp_path, "upd", body + GPTQ.replace("}", ", scales: updated}"))
    _quantize(tiny_bf16, _recipe(tmp_path, "rtn", NVFP4.replace("WS", "max")), tmp_path / "rtn")
    report = _quantize(tiny_bf16, updated, tmp_path / "u1")
    _quantize(tiny_bf16, updated, tmp_path / "u2")
    assert tree_sha(tmp_path / "u1") == tree_sha(tmp_path / "u2")
    got, rtn = _tensors(tmp_path / "u1"), _tensors(tmp_path / "rtn")
    assert got.keys() == rtn.keys()
    for n, tensor in got.items():
        assert tensor.dtype == rtn[n].dtype and tensor.shape == rtn[n].shape, n
        if n.endswith((".weight_scale_2", ".input_scale")):
            assert torch.equal(tensor, rtn[n]), n  # the max's global scale: plain NVFP4
    experts = [
        n[: -len(".weight")]
        for n in got
        if n.endswith("_proj.weight") and ".mlp.experts." in n and not n.startswith("mtp.")  # MTP: BF16
    ]
    assert sum(not torch.equal(got[f"{e}.weight_scale"], rtn[f"{e}.weight_scale"]) for e in experts) > len(experts) // 2
    for e in experts:
        w = nvfp4.dequantize(
            got[f"{e}.weight"],
            got[f"{e}.weight_scale"].view(torch.float8_e4m3fn),
            got[f"{e}.weight_scale_2"],
            torch.float32,
        )
        assert w.isfinite().all(), e
    assert all(entry["gptq"]["rtn_experts"] == entry["experts_without_tokens"] for entry in report["layers"])
    assert all(entry["gptq"]["scales"] == "updated" for entry in report["layers"])


def test_updated_scales_code_an_expert_without_tokens_as_mse_sweep_and_one_with_few_finitely():
    """gptq.scales updated, local_hessian: expert 1 saw no token (its bytes are mse_sweep RTN's: no Hessian to
    weigh the error with), expert 0 a single token (a rank-1 Hessian, damped: finite weights)."""
    from qtool.formats import nvfp4
    from qtool.ops.quantize.calib import ExpertStats
    from qtool.ops.quantize.gptq_layer import GptqLayer
    from qtool.ops.quantize.layer import nvfp4_rtn

    def recipe(weight_scale: str, gptq: dict | None = None):
        data = {"schema_version": 1, "name": "x", "groups": {"routed_experts": "nvfp4"}}
        return parse_recipe({**data, "nvfp4": {"weight_scale": weight_scale}, **({"gptq": gptq} if gptq else {})})

    upd = recipe("local_hessian", {"enabled": True, "scales": "updated"})
    hidden, inter = 32, 16
    gu, dn = torch.randn(2, 2 * inter, hidden).bfloat16(), torch.randn(2, hidden, inter).bfloat16()
    stats = ExpertStats(2)
    coder = GptqLayer(upd, stats, inter, experts=None)
    stats.hooks += coder.hooks
    stats.record(0, torch.randn(1, hidden).bfloat16(), torch.randn(1, inter).bfloat16())
    amax = torch.ones(2)
    got = coder.nvfp4_chunk(0, 2, gu, dn, amax, amax)
    rtn = nvfp4_rtn(gu, dn, inter, amax, amax, recipe("mse_sweep"))
    for part in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(got[part].packed[1], rtn[part].packed[1]), part
        assert torch.equal(got[part].block_scale[1].view(torch.uint8), rtn[part].block_scale[1].view(torch.uint8))
        q = got[part]
        assert nvfp4.dequantize(q.packed, q.block_scale, q.weight_scale_2, torch.float32).isfinite().all(), part
    assert coder.summary()["rtn_experts"] == [1]


def test_an_expert_without_tokens_is_coded_by_rtn_and_named():
    """The GPTQ coder of a layer where expert 1 saw no token: its bytes are RTN's, and the report names it."""
    from qtool.ops.quantize.calib import ExpertStats
    from qtool.ops.quantize.gptq_layer import GptqLayer
    from qtool.ops.quantize.layer import nvfp4_rtn

    recipe = parse_recipe(
        {"schema_version": 1, "name": "x", "groups": {"routed_experts": "nvfp4"}, "gptq": {"enabled": True}}
    )
    hidden, inter = 32, 16
    gu, dn = torch.randn(2, 2 * inter, hidden).bfloat16(), torch.randn(2, hidden, inter).bfloat16()
    stats = ExpertStats(2)
    coder = GptqLayer(recipe, stats, inter, experts=None)
    stats.hooks += coder.hooks
    x = torch.randn(64, hidden) @ torch.randn(hidden, hidden)
    stats.record(0, x.bfloat16(), torch.randn(64, inter).bfloat16())
    amax = torch.ones(2)
    got = coder.nvfp4_chunk(0, 2, gu, dn, amax, amax)
    rtn = nvfp4_rtn(gu, dn, inter, amax, amax, recipe)
    for part in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(got[part].packed[1], rtn[part].packed[1]), part
        assert torch.equal(got[part].block_scale[1].view(torch.uint8), rtn[part].block_scale[1].view(torch.uint8))
    assert not torch.equal(got["gate_proj"].packed[0], rtn["gate_proj"].packed[0])
    assert coder.summary()["rtn_experts"] == [1]


def test_a_solve_group_larger_than_the_writers_chunk_gives_the_same_bytes(monkeypatch):
    """The coder solves SOLVE_EXPERTS experts at once and hands the writer its chunks' slices: the same bytes as
    solving each chunk alone."""
    from types import SimpleNamespace

    from qtool.ops.quantize import gptq_layer, hessians
    from qtool.ops.quantize.calib import ExpertStats

    recipe = parse_recipe(
        {"schema_version": 1, "name": "x", "groups": {"routed_experts": "nvfp4"}, "gptq": {"enabled": True}}
    )
    hidden, inter, n = 32, 16, 4
    experts = SimpleNamespace(
        gate_up_proj=torch.randn(n, 2 * inter, hidden).bfloat16(), down_proj=torch.randn(n, hidden, inter).bfloat16()
    )

    def coder(solve: int):
        monkeypatch.setattr(hessians, "SOLVE_EXPERTS", solve)
        torch.manual_seed(0)
        stats = ExpertStats(n)
        layer = gptq_layer.GptqLayer(recipe, stats, inter, experts)
        stats.hooks += layer.hooks
        for e in range(n):
            stats.record(e, torch.randn(32, hidden).bfloat16(), torch.randn(32, inter).bfloat16())
        return layer

    amax = torch.ones(2)
    by_group, alone = coder(4), coder(2)
    for e0 in (0, 2):
        args = (experts.gate_up_proj[e0 : e0 + 2], experts.down_proj[e0 : e0 + 2], amax, amax)
        a, b = by_group.nvfp4_chunk(e0, e0 + 2, *args), alone.nvfp4_chunk(e0, e0 + 2, *args)
        for part in a:
            assert torch.equal(a[part].packed, b[part].packed), (e0, part)


def test_the_plans_memory_fit_counts_the_hessians(tiny_bf16, tmp_path):
    """The layer's Hessians and a solve group's transients are in the plan's peak (on the forward's device;
    the host on a CPU), and a GPTQ layer is coded right after its forward (one layer held)."""
    from qtool.ops.quantize import QuantizeOptions, plan
    from qtool.ops.quantize.hessians import gptq_memory_bytes

    body = NVFP4.replace("WS", "max")
    rtn = plan(QuantizeOptions(tiny_bf16, tmp_path / "a", load_recipe(_recipe(tmp_path, "r", body)), samples=2))
    gptq = plan(QuantizeOptions(tiny_bf16, tmp_path / "b", load_recipe(_recipe(tmp_path, "g", body + GPTQ)), samples=2))
    extra = gptq_memory_bytes(gptq.n_experts, gptq.hidden, gptq.inter)
    assert gptq.layers_in_flight == 1
    assert gptq.memory_need().host_bytes == rtn.memory_need(0).host_bytes + extra
    # at the 397B's size: 512 experts x (4096^2 + 1024^2) x 4 bytes of Hessians
    assert gptq_memory_bytes(512, 4096, 1024) - gptq_memory_bytes(0, 4096, 1024) == 34 * 2**30


def test_each_rank_plans_the_hessians_of_the_experts_it_codes(tiny_bf16, tmp_path, monkeypatch):
    """With several ranks a rank sums the Hessians of its solve groups only (layer.Share): N times fewer."""
    from qtool.ops.quantize import QuantizeOptions, plan
    from qtool.ops.quantize.hessians import gptq_memory_bytes

    recipe = load_recipe(_recipe(tmp_path, "g", NVFP4.replace("WS", "max") + GPTQ))
    one = plan(QuantizeOptions(tiny_bf16, tmp_path / "a", recipe, samples=2)).gptq_bytes
    monkeypatch.setattr("qtool.dist.planned_ranks", lambda: 2)
    two = plan(QuantizeOptions(tiny_bf16, tmp_path / "b", recipe, samples=2))
    assert two.gptq_bytes == one  # 8 experts: one solve group, which a rank may hold whole
    assert two.memory_need().ranks == 2
    hessians = 512 * (4096**2 + 1024**2) * 4  # the 397B's layer: 34 GiB
    for ranks in (1, 2, 4, 8):
        assert gptq_memory_bytes(512, 4096, 1024, ranks) - gptq_memory_bytes(0, 4096, 1024) == hessians // ranks
