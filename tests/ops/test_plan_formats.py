"""qtool sensitivity --formats + qtool plan hybrid choosing one format per unit, on the tiny fixtures.

The pair: the tiny BF16 model and its ModelOpt NVFP4 export (routed experts NVFP4, the rest BF16: the
reference the memory fit starts from). Measured: every layer unit in each format it takes, with the bytes
quantize then writes for it; the plan is the multiple-choice knapsack's optimum (checked against brute force),
its recipe quantizes and verifies; a table made without --formats is the table it always was."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from qtool.cli.main import main
from qtool.ops.sensitivity.plan_formats import choose_formats

WINDOWS = ["--samples", "2", "--seq-len", "32"]
FORMATS = "bf16,fp8,nvfp4:mse_sweep"
TARGET = ["--tp", "1", "--gpus", "1x80GiB"]


def run_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    rc = main([*map(str, argv), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    return json.loads(out)


def refused(capsys, argv: list, code: int, *named: str) -> str:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    said = capsys.readouterr()
    text = said.out + said.err
    assert rc == code, text
    assert "Traceback" not in text
    for name in named:
        assert name in text, (name, text)
    return text


# ---- the knapsack ---------------------------------------------------------------------------------------


def _brute(options, budget):
    best = None
    for pick in itertools.product(*(range(len(o)) for o in options)):
        cost = sum(options[g][k][0] for g, k in enumerate(pick))
        loss = sum(options[g][k][1] for g, k in enumerate(pick))
        if cost <= budget and (best is None or loss < best - 1e-12):
            best = loss
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_multiple_choice_knapsack_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    options = [
        [(rng.randint(-30, 60), round(rng.random(), 3)) for _ in range(rng.randint(1, 3))]
        for _ in range(rng.randint(1, 6))
    ]
    budget = rng.randint(-40, 150)
    pick = choose_formats(options, budget)
    best = _brute(options, budget)
    if best is None:
        assert pick is None
        return
    assert sum(options[g][k][0] for g, k in enumerate(pick)) <= budget
    assert sum(options[g][k][1] for g, k in enumerate(pick)) == pytest.approx(best)


def test_a_coarse_grid_never_exceeds_the_budget():
    rng = random.Random(7)
    options = [[(rng.randint(0, 10**9), rng.random()) for _ in range(3)] for _ in range(50)]
    budget = sum(min(c for c, _ in o) for o in options) + 3 * 10**9  # room for a few larger choices
    pick = choose_formats(options, budget, grid=1000)  # cells of ~3 MB: costs rounded up to them
    assert pick is not None
    assert sum(options[g][k][0] for g, k in enumerate(pick)) <= budget


# ---- the table and the plan, end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_bf16, tiny_nvfp4_modelopt_nomtp):
    return tiny_bf16, tiny_nvfp4_modelopt_nomtp


@pytest.fixture(scope="module")
def tables(pair, tmp_path_factory):
    """The pair's table with --formats and without (the same windows)."""
    import contextlib
    import io

    bf, q = pair
    d = tmp_path_factory.mktemp("plan-formats")
    out = {}
    for name, extra in (("formats", ["--formats", FORMATS]), ("plain", [])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            argv = ["sensitivity", str(bf), str(q), "-o", str(d / name), *WINDOWS, *extra, "--quiet", "--json"]
            assert main(argv) == 0
        out[name] = d / name
    return out


def _table(path: Path) -> dict:
    return json.loads((path / "sensitivity.json").read_text())


def test_a_table_without_formats_is_the_table_it_always_was(tables):
    plain, formats = _table(tables["plain"]), _table(tables["formats"])
    assert plain["schema_version"] == 1 and "formats" not in plain
    assert all("formats" not in u and "group" not in u for u in plain["units"])
    assert formats["schema_version"] == 2
    assert formats["formats"] == {"candidates": ["bf16", "fp8", "nvfp4"], "nvfp4": {"weight_scale": "mse_sweep"}}
    # the schema-1 columns are the same numbers: --formats only adds rows
    stripped = [{k: v for k, v in u.items() if k not in ("formats", "group")} for u in formats["units"]]
    assert stripped == plain["units"]


def test_every_layer_unit_is_measured_in_each_format_its_group_takes(tables):
    units = {u["id"]: u for u in _table(tables["formats"])["units"]}
    for i in range(8):
        assert set(units[f"layer.{i}.routed_experts"]["formats"]) == {"bf16", "nvfp4"}
        assert set(units[f"layer.{i}.shared_expert"]["formats"]) == {"bf16", "fp8"}
        assert set(units[f"layer.{i}.attention"]["formats"]) == {"bf16", "fp8"}
    assert units["layer.3.attention"]["group"] == "attention" and units["layer.0.attention"]["group"] == "linear_attn"
    for u in units.values():
        for fmt, row in (u.get("formats") or {}).items():
            assert (row["effect"] == 0) == (fmt == "bf16") and row["error"] >= 0
            assert row["bytes"] < u["bf16_bytes"] or fmt == "bf16"
        if "formats" in u:  # BF16 costs what the schema-1 column says
            assert u["formats"]["bf16"]["extra_bytes_per_gpu"] == u["extra_bytes_per_gpu"]


def test_the_planned_recipe_quantizes_to_the_table_bytes_and_verifies(pair, tables, tmp_path, capsys):
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.sensitivity.units import unit_modules
    from qtool.recipes import load_recipe

    bf, _ = pair
    table = _table(tables["formats"])
    recipe = tmp_path / "planned.yaml"
    # a budget between all-smallest and all-BF16: the plan must mix formats
    plan = run_json(capsys, ["plan", "hybrid", "--sensitivity", tables["formats"], *TARGET, "-o", recipe])
    rows = {u["id"]: u for u in table["units"]}
    tight = run_json(
        capsys, ["plan", "hybrid", "--sensitivity", tables["formats"], *TARGET, "--max-weights-gib", "0.0014"]
    )
    assert set(plan["count"]) == {"bf16"}  # 80 GiB: everything BF16 (the least error)
    assert len(tight["count"]) == 3 and tight["used_bytes_per_gpu"] <= tight["budget_bytes_per_gpu"]
    assert tight["predicted_error"]["planned"] < tight["predicted_error"]["quantized"]
    recipe = tmp_path / "tight.yaml"
    run_json(
        capsys,
        ["plan", "hybrid", "--sensitivity", tables["formats"], *TARGET, "--max-weights-gib", "0.0014", "-o", recipe],
    )
    assert recipe.read_text().startswith("# written by qtool plan hybrid")
    r = load_recipe(recipe)
    assert r.layer_overrides and r.nvfp4.weight_scale.value == "mse_sweep"
    out = tmp_path / "q"
    assert main(["quantize", str(bf), "--recipe", str(recipe), "-o", str(out), *WINDOWS, "--quiet"]) == 0
    assert main(["verify", str(out), *TARGET]) == 0
    have = {u: sum(m.nbytes() for m in ms) for u, ms in unit_modules(build_map(Checkpoint.open(out))).items()}
    for c in tight["chosen"]:
        u = rows[c["id"]]
        assert r.scheme_for(u["group"], u["layer"]).value == c["format"]
        assert have[c["id"]] == u["formats"][c["format"]]["bytes"], c


def test_an_old_table_still_plans_the_bf16_splice(tables, capsys):
    rep = run_json(capsys, ["plan", "hybrid", "--sensitivity", tables["plain"], *TARGET])
    assert "assemble" in rep and "count" not in rep


# ---- bad input: named, with the fix ------------------------------------------------------------------


def test_an_unknown_format_is_a_usage_error(pair, tmp_path, capsys):
    bf, q = pair
    for bad in ("bf16,int3", "fp8:mse", "nvfp4:best", "fp8,fp8"):
        refused(capsys, ["sensitivity", bf, q, "-o", tmp_path / "s", "--formats", bad], 2, "--formats")
    assert not (tmp_path / "s").exists()


def test_a_format_the_table_did_not_measure_is_named_with_the_fix(tables, capsys):
    text = refused(
        capsys,
        ["plan", "hybrid", "--sensitivity", tables["formats"], *TARGET, "--formats", "bf16,nvfp4:max"],
        1,
        "sensitivity.json",
        "nvfp4:max",
        "--formats bf16,fp8,nvfp4",
    )
    assert "qtool sensitivity" in text
    refused(
        capsys,
        ["plan", "hybrid", "--sensitivity", tables["plain"], *TARGET, "--formats", "bf16,fp8"],
        1,
        "sensitivity.json",
        "without --formats",
        "qtool sensitivity BF16 QUANTIZED -o OUT --formats",
    )
    refused(
        capsys,
        ["plan", "hybrid", "--sensitivity", tables["formats"], *TARGET, "--formats", "nvfp4"],
        1,
        "layer.0.shared_expert takes none of the formats",
        "add one of bf16, fp8 to --formats",
    )


def test_a_format_row_without_its_measure_is_named(tables, tmp_path, capsys):
    data = _table(tables["formats"])
    del data["units"][0]["formats"]["nvfp4"]["effect"]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "sensitivity.json").write_text(json.dumps(data))
    refused(
        capsys,
        ["plan", "hybrid", "--sensitivity", tmp_path / "t", *TARGET],
        1,
        "sensitivity.json",
        "units[0] (layer.0.routed_experts).formats.nvfp4.effect is missing",
    )
