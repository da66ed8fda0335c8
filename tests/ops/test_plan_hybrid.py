"""qtool sensitivity + qtool plan hybrid on the tiny fixtures, proved by measurement.

The pair: the tiny BF16 model, with one layer's routed experts given an outlier in every 16-weight block
(what makes a real layer quantize badly: the block scale follows the outlier and the other 15 weights
round to few levels), and its NVFP4 export by ModelOpt with the shared experts NVFP4 too (nvidia's own
397B export quantizes them; NVFP4_MLP_ONLY_CFG). Measured: the planned hybrid's KLD against BF16 is lower
than the hand-picked hybrid's (BF16 shared experts in every layer) at the same memory per GPU, and lower
than the median of 5 random picks of that memory; the recipe builds and verifies."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from qtool.cli.main import main

OUTLIER_LAYER = 5
WINDOWS = ["--samples", "4", "--seq-len", "64"]


def run_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    return json.loads(out)


def with_outliers(src: Path, dst: Path, layer: int) -> Path:
    """A copy of the BF16 checkpoint whose layer `layer` routed experts have one large weight per block."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    tag = f"layers.{layer}.mlp.experts."
    for shard in sorted({f for n, f in idx["weight_map"].items() if tag in n}):
        with safe_open(str(dst / shard), "pt") as f:
            meta = f.metadata()
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        for n, t in tensors.items():
            if tag in n:
                t = t.clone()
                t[..., ::16] = t[..., ::16].sign() * t.abs().amax() * 8  # one outlier per 16-block of a row
                tensors[n] = t.contiguous()
        (dst / shard).unlink()
        save_file(tensors, str(dst / shard), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def pair(tiny_bf16, tmp_path_factory):
    from qtool.fixtures.quantized import build_nvfp4_modelopt

    d = tmp_path_factory.mktemp("plan-hybrid")
    bf = with_outliers(tiny_bf16, d / "bf16", OUTLIER_LAYER)
    q = build_nvfp4_modelopt(bf, d / "nvfp4", quant_cfg="NVFP4_MLP_ONLY_CFG", max_shard_size="2MB")
    return bf, q, d


@pytest.fixture(scope="module")
def table(pair):
    bf, q, d = pair
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["sensitivity", str(bf), str(q), "-o", str(d / "sens"), *WINDOWS, "--quiet", "--json"]) == 0
    return json.loads(buf.getvalue())["table"]


def test_the_table_covers_every_unit_and_finds_the_bad_layer(table):
    ids = {u["id"] for u in table["units"]}
    want = {f"layer.{i}.{k}" for i in range(8) for k in ("routed_experts", "shared_expert", "attention")}
    assert want | {"lm_head"} <= ids
    measured = {u["id"]: u for u in table["units"] if u["measured"]}
    # every unit the NVFP4 side quantizes (routed + shared experts), no other
    assert set(measured) == {f"layer.{i}.{k}" for i in range(8) for k in ("routed_experts", "shared_expert")}
    assert all(u["error"] > 0 and u["effect"] > 0 and u["tokens"] == 4 * 64 for u in measured.values())
    bad = measured[f"layer.{OUTLIER_LAYER}.routed_experts"]
    assert bad["effect"] == max(u["effect"] for u in measured.values())
    # costs: a layer's experts in BF16 (8 experts x 3 x 32 x 64 x 2 bytes) minus their NVFP4 bytes
    assert bad["bf16_bytes"] == 8 * 3 * 32 * 64 * 2 and 0 < bad["quantized_bytes"] < bad["bf16_bytes"] / 3
    assert bad["extra_bytes_per_gpu"]["2"] == pytest.approx((bad["bf16_bytes"] - bad["quantized_bytes"]) / 2, abs=8)


def _kld(capsys, bf: Path, test: Path) -> float:
    rep = run_json(
        capsys, ["eval", "kld", "--ref", str(bf), "--test", str(test), "--windows", "4", "--seq-len", "64", "--quiet"]
    )
    return rep["mean"]


def _assemble(capsys, bf, q, out: Path, experts: list[int], shared: list[int]) -> Path:
    run_json(
        capsys,
        [
            "assemble",
            "hybrid",
            "--nvfp4",
            str(q),
            "--bf16",
            str(bf),
            "-o",
            str(out),
            "--mtp",
            "keep",
            "--bf16-expert-layers",
            ",".join(map(str, experts)) or "none",
            "--bf16-shared-experts",
            ",".join(map(str, shared)) or "none",
            "--quiet",
        ],
    )
    return out


def test_the_planned_hybrid_beats_the_hand_picked_and_random_picks_of_equal_memory(pair, table, capsys):
    bf, q, d = pair
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.verify.memory_fit import GIB, weights_per_gpu

    units = {u["id"]: u for u in table["units"]}
    shared_cost = sum(
        u["extra_bytes_per_gpu"]["1"] for u in units.values() if u["kind"] == "shared_expert" and u["spliceable"]
    )
    weights = sum(weights_per_gpu(build_map(Checkpoint.open(q)), 1, mtp=False).values())
    # the budget: exactly what the hand-picked hybrid (every shared expert BF16) adds per GPU
    recipe = d / "planned.yaml"
    plan = run_json(
        capsys,
        [
            "plan",
            "hybrid",
            "--sensitivity",
            str(d / "sens"),
            "--tp",
            "1",
            "--max-weights-gib",
            repr((weights + shared_cost) / GIB),
            "-o",
            str(recipe),
        ],
    )
    chosen = {c["id"] for c in plan["chosen"]}
    assert plan["used_bytes_per_gpu"] <= shared_cost
    assert f"layer.{OUTLIER_LAYER}.routed_experts" in chosen
    assert plan["hand_picked"]["extra_bytes_per_gpu"] == shared_cost
    assert plan["predicted_error"]["planned"] < plan["hand_picked"]["predicted_error"]

    # the recipe builds and verifies (its last step is verify at the planned target)
    built = run_json(capsys, ["build", str(recipe), "-o", str(d / "planned"), "--quiet"])
    assert [s["op"] for s in built["steps"]] == ["assemble", "calibrate-kv", "patch-config", "verify"]
    assert built["published"] and built["steps"][-1]["with"]["tp"] == 1
    planned = d / "planned"
    assert (planned / "config.json").exists()

    hand = _assemble(capsys, bf, q, d / "hand", [], list(range(8)))
    experts = sorted(int(c.split(".")[1]) for c in chosen if c.endswith("routed_experts"))
    shared = sorted(int(c.split(".")[1]) for c in chosen if c.endswith("shared_expert"))
    rng = random.Random(28)
    randoms = []
    for k in range(5):  # the same numbers of each kind of unit: the same memory, other layers
        e, s = rng.sample(range(8), len(experts)), rng.sample(range(8), len(shared))
        randoms.append((e, s, _assemble(capsys, bf, q, d / f"random{k}", sorted(e), sorted(s))))
    kld = {
        "quantized": _kld(capsys, bf, q),
        "planned": _kld(capsys, bf, planned),
        "hand-picked": _kld(capsys, bf, hand),
    }
    for k, (_, _, path) in enumerate(randoms):
        kld[f"random{k}"] = _kld(capsys, bf, path)
    median_random = statistics.median(kld[f"random{k}"] for k in range(5))
    print("KLD vs BF16 (mean):", json.dumps(kld, indent=1), "median random", median_random)
    assert kld["planned"] < kld["hand-picked"] < kld["quantized"]
    assert kld["planned"] < median_random

    # the planner's prediction against the measurement: rank correlation over the hybrids
    def predicted(exp, sh) -> float:
        bf16 = {f"layer.{i}.routed_experts" for i in exp} | {f"layer.{i}.shared_expert" for i in sh}
        return sum(u["effect"] for u in units.values() if u["measured"] and u["id"] not in bf16)

    pred = {
        "quantized": predicted([], []),
        "planned": predicted(experts, shared),
        "hand-picked": predicted([], range(8)),
    }
    for k, (e, s, _) in enumerate(randoms):
        pred[f"random{k}"] = predicted(e, s)
    names = sorted(kld)
    rho = _spearman([pred[n] for n in names], [kld[n] for n in names])
    print("predicted error:", json.dumps(pred, indent=1), "Spearman rho", rho)
    assert rho > 0  # reported in the issue's note; the random picks' predictions nearly tie


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def test_both_nvfp4_flavours_and_awq_give_a_table_of_every_unit(tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    """compressed-tensors NVFP4 (llm-compressor's export: routed experts) and AWQ INT4 (qtool quantize's
    qwen35-awq-int4: layer 0's experts BF16) are measured unit by unit; only NVFP4 can be spliced."""
    ct = run_json(
        capsys, ["sensitivity", str(tiny_bf16), str(tiny_nvfp4_ct), "-o", str(tmp_path / "ct"), *WINDOWS, "--quiet"]
    )["table"]
    measured = {u["id"]: u for u in ct["units"] if u["measured"]}
    assert set(measured) == {f"layer.{i}.routed_experts" for i in range(8)}
    assert {u["quantized_format"] for u in measured.values()} == {"nvfp4-ct"}
    assert all(u["spliceable"] and u["effect"] > 0 for u in measured.values())
    shared = [u for u in ct["units"] if u["kind"] == "shared_expert"]
    assert shared and all(not u["measured"] and u["note"] == "BF16 in both checkpoints" for u in shared)

    awq = tmp_path / "awq"
    run_json(capsys, ["quantize", str(tiny_bf16), "-o", str(awq), "--recipe", "qwen35-awq-int4", *WINDOWS, "--quiet"])
    table = run_json(
        capsys, ["sensitivity", str(tiny_bf16), str(awq), "-o", str(tmp_path / "awq-sens"), *WINDOWS, "--quiet"]
    )["table"]
    measured = {u["id"]: u for u in table["units"] if u["measured"]}
    assert set(measured) == {f"layer.{i}.routed_experts" for i in range(1, 8)}  # the recipe keeps layer 0 BF16
    assert all(u["error"] > 0 and not u["spliceable"] for u in measured.values())
    capsys.readouterr()
    assert main(["plan", "hybrid", "--sensitivity", str(tmp_path / "awq-sens"), "--tp", "1"]) == 1
    assert "nothing in this table can be spliced" in capsys.readouterr().err


def test_checkpoints_that_do_not_pair_are_named(tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    import shutil

    capsys.readouterr()
    assert main(["sensitivity", str(tiny_nvfp4_ct), str(tiny_bf16), "-o", str(tmp_path / "s"), "--dry-run"]) == 1
    assert "the second checkpoint has no quantized module" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(tiny_bf16, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 16
    (other / "config.json").write_text(json.dumps(cfg))
    assert main(["sensitivity", str(other), str(tiny_nvfp4_ct), "-o", str(tmp_path / "s"), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "not one model: num_experts differs" in err and "config.json" in err
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


@pytest.mark.slow
def test_a_sparse_397b_pair_plans_from_the_table_and_headers(tmp_path_factory, capsys, tiny_nvfp4_ct):
    """The real 397B's headers (nvidia's NVFP4 layout, shared experts NVFP4; the BF16 release), holes for
    data: the unit table and costs come from the headers; the effects are stand-ins (a sensitivity run needs
    the weights), made so that the choice is known: later layers matter more."""
    import time

    from sensitivity_stand_in import write_stand_in_table

    from qtool.arch.model_map import build_map
    from qtool.fixtures.sparse import build_sparse
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.verify.memory_fit import GIB, Target, memory_fit

    d = tmp_path_factory.mktemp("s397-plan")
    bf = build_sparse(d / "bf16", model="397b", flavour="bf16-fused")
    q = build_sparse(d / "nvfp4", model="397b", flavour="modelopt-nvfp4", quantize_shared_expert=True)
    units = write_stand_in_table(bf, q, d / "sens")
    t0 = time.perf_counter()
    plan = run_json(
        capsys,
        [
            "plan",
            "hybrid",
            "--sensitivity",
            str(d / "sens"),
            "--gpus",
            "4x97887MiB",
            "--tp",
            "4",
            "--max-model-len",
            "262144",
            "--max-num-seqs",
            "4",
            "--kv-cache-dtype",
            "fp8",
            "-o",
            str(d / "plan.yaml"),
        ],
    )
    print(f"plan hybrid of the sparse 397B pair: {time.perf_counter() - t0:.1f} s")
    shared = [u for u in units if u.kind == "shared_expert" and u.quantized]
    experts = [u for u in units if u.kind == "routed_experts"]
    assert len(shared) == 60 and len(experts) == 60
    # a 397B layer's experts: 12.9 GB in BF16, 3.6 GB in NVFP4, so 2.2 GiB more per GPU at TP=4 in BF16;
    # a shared expert 25 MB vs 7 MB: 4.5 MB more per GPU
    assert 2.0 * GIB < experts[0].extra_bytes_per_gpu[4] < 2.4 * GIB
    assert 4.0e6 < shared[0].extra_bytes_per_gpu[4] < 5.0e6
    chosen = {c["id"] for c in plan["chosen"]}
    assert {u.id for u in shared} <= chosen  # the stand-ins make them the best gain per byte
    # what was chosen fits: the quantized checkpoint's fit at the target, plus the chosen units' bytes
    fit = memory_fit(
        build_map(Checkpoint.open(q)),
        tp=4,
        target=Target.parse("4x97887MiB"),
        kv_cache_dtype="fp8",
        max_model_len=262144,
        max_num_seqs=4,
    )
    assert fit.fits
    assert plan["used_bytes_per_gpu"] <= plan["budget_bytes_per_gpu"] <= fit.usage_gib["unused"] * GIB + 1
    nxt = plan["next"]
    assert nxt is None or nxt["extra_bytes_per_gpu"] > plan["headroom_bytes_per_gpu"]
    # the table and another checkpoint (found by a new user's try: it planned 60 layers for an 8-layer model)
    assert (
        main(["plan", "hybrid", "--sensitivity", str(d / "sens"), "--tp", "1", "--quantized", str(tiny_nvfp4_ct)]) == 1
    )
    assert "not the one the table measured" in capsys.readouterr().err
    assert (
        main(["report", str(tiny_nvfp4_ct), "--tp", "1", "--sensitivity", str(d / "sens"), "-o", str(d / "r.html")])
        == 1
    )
    assert "measured on another model" in capsys.readouterr().err and not (d / "r.html").exists()
    # what a person reads: one line per kind of unit when there are dozens
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "hybrid",
                "--sensitivity",
                str(d / "sens"),
                "--tp",
                "4",
                "--max-model-len",
                "262144",
                "--max-num-seqs",
                "4",
                "--kv-cache-dtype",
                "fp8",
                "--dry-run",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "shared_expert    layers 0-59: 60 unit(s)" in text and "dry run: no recipe written" in text
    from qtool.build_recipes import load_build_recipe

    recipe = load_build_recipe(d / "plan.yaml")
    assert [s.op.value for s in recipe.steps] == ["assemble", "calibrate-kv", "patch-config", "verify"]


@pytest.mark.slow
def test_a_killed_sensitivity_run_resumes_at_its_next_layer_to_the_same_table(tiny_bf16, tiny_nvfp4_ct, tmp_path):
    """kill -9 right after the 4th journal entry (layers 0-2 done): --resume runs layers 3-7 only and gives
    the table of an uninterrupted run; without --resume it says it starts over."""
    from in_process import run_cli
    from killpoint import run_killed

    args = [
        "sensitivity",
        tiny_bf16,
        tiny_nvfp4_ct,
        "--samples",
        "4",
        "--seq-len",
        "32",
        "--batch-tokens",
        "64",
        "--quiet",
    ]
    clean, out = tmp_path / "clean", tmp_path / "out"
    assert run_cli([*args, "-o", clean]).returncode == 0
    killed = run_killed("qtool.io.jsonio:write_json", 4, [*args, "-o", out])
    assert killed.returncode == -9 and not out.exists()
    journal = json.loads((tmp_path / "out.partial/.sensitivity/journal.json").read_text())
    assert journal["next_layer"] == 3
    p = run_cli([*args, "-o", out, "--resume", "--json"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["timing"]["resumed_from_layer"] == 3
    rows = lambda d: json.loads((d / "sensitivity.json").read_text())["units"]  # noqa: E731
    assert rows(out) == rows(clean)
    # killed again, then run without --resume: it says that it starts over
    assert run_killed("qtool.io.jsonio:write_json", 2, [*args, "-o", tmp_path / "again"]).returncode == -9
    p = run_cli([*args[:-1], "-o", tmp_path / "again"])  # (without --quiet: the notice is for the user)
    assert p.returncode == 0 and "starting over" in p.stderr, p.stderr[-2000:]


def test_the_report_draws_the_sensitivity_as_a_heat_layer_on_its_grid(pair, table, tmp_path, capsys):
    import re

    bf, q, d = pair
    out = tmp_path / "r.html"
    capsys.readouterr()
    assert main(["report", str(q), "--tp", "1", "--sensitivity", str(d / "sens"), "-o", str(out), "--quiet"]) == 0
    html = out.read_text()
    cells = re.findall(r'data-row="([^"]+)" data-col="([^"]+)"[^>]*data-effect="([^"]+)" data-rank="(\d+)"', html)
    measured = [u for u in table["units"] if u["measured"]]
    assert len(cells) == len(measured) == html.count('class="heat"')
    ranks = {(r, c): int(k) for r, c, _, k in cells}
    assert ranks[(f"layer {OUTLIER_LAYER}", "routed_experts")] == 1
    assert f"layer {OUTLIER_LAYER} routed experts (#1)" in html
    # a file that is not a sensitivity table: named before any of the page's work
    (tmp_path / "x.json").write_text("{}")
    assert (
        main(
            ["report", str(q), "--tp", "1", "--sensitivity", str(tmp_path / "x.json"), "-o", str(tmp_path / "r2.html")]
        )
        == 1
    )
    assert "not a qtool sensitivity table" in capsys.readouterr().err and not (tmp_path / "r2.html").exists()


def test_a_tp_the_model_does_not_shard_at_is_refused_and_a_dry_run_writes_nothing(pair, table, tmp_path, capsys):
    bf, q, d = pair
    capsys.readouterr()
    assert main(["plan", "hybrid", "--sensitivity", str(d / "sens"), "--tp", "4", "-o", str(tmp_path / "p.yaml")]) == 1
    err = capsys.readouterr().err
    assert "--tp 4" in err and "do not split over TP=4" in err and "--tp 2" in err
    # found by a new user's try: a TP the table has no costs for was answered with one the model does not
    # shard at; --mtp -1 went into the recipe; a mistyped table path was told to "restore" it
    assert main(["plan", "hybrid", "--sensitivity", str(d / "sens"), "--tp", "3", "--gpus", "3x90GB"]) == 1
    err = capsys.readouterr().err
    assert "shards at (1, 2)" in err and "--tp 2" in err and "--tp 8" not in err
    assert main(["plan", "hybrid", "--sensitivity", str(d / "sens"), "--tp", "1", "--mtp", "-1"]) == 2
    assert "--mtp must be >= 0" in capsys.readouterr().err
    assert main(["plan", "hybrid", "--sensitivity", str(tmp_path / "nosuch"), "--tp", "1"]) == 1
    assert "no sensitivity table there" in capsys.readouterr().err
    rep = run_json(
        capsys,
        ["plan", "hybrid", "--sensitivity", str(d / "sens"), "--tp", "2", "--dry-run", "-o", str(tmp_path / "p.yaml")],
    )
    assert rep["dry_run"] and rep["recipe"] is None and rep["chosen"] and not (tmp_path / "p.yaml").exists()
    assert rep["fit"]["usage_gib"]["unused"] * (1 << 30) == pytest.approx(rep["budget_bytes_per_gpu"], rel=1e-4)


def test_the_knapsack_finds_the_best_set_within_the_budget():
    """Against brute force on small random sets, with budgets that bind."""
    import itertools

    from qtool.ops.sensitivity import plan_hybrid

    rng = random.Random(7)
    for _ in range(200):
        items = [(rng.randint(1, 50), rng.random()) for _ in range(rng.randint(1, 9))]
        budget = rng.randint(0, sum(c for c, _ in items))
        pick = plan_hybrid.knapsack(items, budget)
        assert sum(items[k][0] for k in pick) <= budget
        best = max(
            (
                sum(items[k][1] for k in combo)
                for r in range(len(items) + 1)
                for combo in itertools.combinations(range(len(items)), r)
                if sum(items[k][0] for k in combo) <= budget
            ),
            default=0.0,
        )
        assert sum(items[k][1] for k in pick) == pytest.approx(best)


def test_a_tight_plan_with_a_grafted_mtp_head_builds_and_verifies_at_its_target(pair, table, tmp_path, capsys):
    """The review's case: the export has no MTP head and --mtp 1 grafts BF16's, whose weights AND KV cache
    the budget must hold. The target leaves room for the head and two of the three layers' worth of units:
    the recipe's own verify step (which counts the grafted head) must pass at exactly that target."""
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.verify.memory_fit import GIB, RESERVE_GIB, Target, kv_bytes_per_token, memory_fit

    bf, q, d = pair
    units = {u["id"]: u for u in table["units"]}
    assert "mtp" in units and units["mtp"]["quantized_bytes"] == 0  # the export has none; BF16 has one
    qm = build_map(Checkpoint.open(q))
    length, seqs = 8192, 2
    base = memory_fit(qm, tp=1, target=Target.parse("1x64GiB"), max_model_len=length, max_num_seqs=seqs)
    used = base.usage_gib["weights"] * GIB + base.usage_gib["kv_cache"] * GIB + base.usage_gib["gdn_state"] * GIB
    mtp_kv = seqs * length * kv_bytes_per_token(qm.ckpt.text_config, 1, 1, "auto")
    room = (
        units["mtp"]["extra_bytes_per_gpu"]["1"]
        + mtp_kv
        + 2 * units[f"layer.{OUTLIER_LAYER}.routed_experts"]["extra_bytes_per_gpu"]["1"]
        + 1000
    )
    gpu = (used + RESERVE_GIB * GIB + room) / 0.9
    gpus = f"1x{gpu / 2**20:.4f}MiB"
    recipe = tmp_path / "tight.yaml"
    plan = run_json(
        capsys,
        [
            "plan",
            "hybrid",
            "--sensitivity",
            str(d / "sens"),
            "--gpus",
            gpus,
            "--tp",
            "1",
            "--max-model-len",
            str(length),
            "--max-num-seqs",
            str(seqs),
            "--mtp",
            "1",
            "-o",
            str(recipe),
        ],
    )
    assert [f["bytes_per_gpu"] for f in plan["fixed"]] == [units["mtp"]["extra_bytes_per_gpu"]["1"], mtp_kv]
    assert (
        plan["used_bytes_per_gpu"]
        <= plan["budget_bytes_per_gpu"]
        < 3 * units[f"layer.{OUTLIER_LAYER}.routed_experts"]["extra_bytes_per_gpu"]["1"]
    )
    built = run_json(capsys, ["build", str(recipe), "-o", str(tmp_path / "tight"), "--quiet"])
    assert built["published"]  # its verify step (MTP counted) passed at the planned target


def test_a_recipe_planned_in_one_folder_builds_from_another(pair, table, tmp_path, capsys, monkeypatch):
    """Found (issue 53): `cd A && qtool plan hybrid ... -o planned.yaml`, then `cd B && qtool build
    A/planned.yaml -o out`: the recipe held the source paths relative to A, and the build failed "path does
    not exist (q-nvfp4)" with no fix line."""
    bf, q, d = pair
    monkeypatch.chdir(d)
    run_json(
        capsys,
        [
            "plan",
            "hybrid",
            "--sensitivity",
            "sens",
            "--quantized",
            q.name,
            "--bf16",
            bf.name,
            "--gpus",
            "1x64GiB",
            "--tp",
            "1",
            "--max-model-len",
            "8192",
            "-o",
            str(tmp_path / "planned.yaml"),
        ],
    )
    (tmp_path / "B").mkdir()
    monkeypatch.chdir(tmp_path / "B")
    assert main(["build", str(tmp_path / "planned.yaml"), "-o", "out", "--dry-run"]) == 0, capsys.readouterr().err
    # a source path that is missing names where relative paths are read from, and what to do
    text = (tmp_path / "planned.yaml").read_text().replace(str(q), q.name)
    (tmp_path / "relative.yaml").write_text(text)
    assert main(["build", str(tmp_path / "relative.yaml"), "-o", "out", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "fix:" in err and "--source nvfp4=PATH" in err, err


# ---- bad inputs: each one a named error (the file or the flag), exit 1 or 2, never a traceback ----------


def refused(capsys, argv: list, code: int, *named: str) -> str:
    """Run the command in process; it must exit `code` naming each of `named`, with no traceback (an
    exception other than the CLI's own exits escapes main() and fails the test)."""
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


@pytest.fixture(scope="module")
def stand_in(tiny_bf16, tiny_nvfp4_ct, tmp_path_factory):
    """A stand-in table for the tiny pair (the real table's rows, effects made up: no streamed pass)."""
    from sensitivity_stand_in import write_stand_in_table

    d = tmp_path_factory.mktemp("plan-inputs")
    write_stand_in_table(tiny_bf16, tiny_nvfp4_ct, d / "sens")
    return d / "sens"


PLAN = ["plan", "hybrid", "--tp", "1", "--gpus", "1x80GiB"]


def _edited_table(stand_in: Path, dst: Path, edit) -> Path:
    data = json.loads((stand_in / "sensitivity.json").read_text())
    edit(data)
    dst.mkdir()
    (dst / "sensitivity.json").write_text(json.dumps(data))
    return dst


def _set_unit(key, value, row=3):
    return lambda data: data["units"][row].__setitem__(key, value)


def _set_top(key, value):
    return lambda data: data.__setitem__(key, value)


BAD_TABLES = {
    "negative effect": (_set_unit("effect", -0.5), "units[3]", "effect"),
    "boolean effect": (_set_unit("effect", True), "units[3]", "effect"),
    "string effect": (_set_unit("effect", "0.1"), "units[3]", "effect"),
    "effect an object": (_set_unit("effect", {"x": 1}), "units[3]", "effect"),
    "error a list": (_set_unit("error", [0.1]), "units[3]", "error"),
    "negative error": (_set_unit("error", -1), "units[3]", "error"),
    "fractional bf16 bytes": (_set_unit("bf16_bytes", 1.5), "units[3]", "bf16_bytes"),
    "negative quantized bytes": (_set_unit("quantized_bytes", -5), "units[3]", "quantized_bytes"),
    "string quantized bytes": (_set_unit("quantized_bytes", "7"), "units[3]", "quantized_bytes"),
    "fractional extra bytes": (
        lambda d: d["units"][3]["extra_bytes_per_gpu"].__setitem__("1", 1.5),
        "units[3]",
        "extra_bytes_per_gpu",
    ),
    "boolean extra bytes": (
        lambda d: d["units"][3]["extra_bytes_per_gpu"].__setitem__("1", True),
        "units[3]",
        "extra_bytes_per_gpu",
    ),
    "extra bytes a list": (_set_unit("extra_bytes_per_gpu", [1, 2]), "units[3]", "extra_bytes_per_gpu"),
    "extra bytes without TP 1": (
        lambda d: d["units"][3]["extra_bytes_per_gpu"].pop("1"),
        "units[3]",
        "extra_bytes_per_gpu",
    ),
    "negative layer": (_set_unit("layer", -1), "units[3]", "layer"),
    "fractional layer": (_set_unit("layer", 1.5), "units[3]", "layer"),
    "string measured": (_set_unit("measured", "yes"), "units[3]", "measured"),
    "number spliceable": (_set_unit("spliceable", 1), "units[3]", "spliceable"),
    "number id": (_set_unit("id", 5), "units[3]", "id"),
    "missing kind": (lambda d: d["units"][3].pop("kind"), "units[3]", "kind"),
    "row not an object": (lambda d: d["units"].__setitem__(3, "x"), "units[3]", "object"),
    "negative tokens": (_set_unit("tokens", -1), "units[3]", "tokens"),
    "tp size 0": (_set_top("tp_sizes", [0, 1]), "tp_sizes", "TP sizes"),
    "tp sizes strings": (_set_top("tp_sizes", ["1"]), "tp_sizes", "TP sizes"),
    "quantized not an object": (_set_top("quantized", "x"), "quantized", "path"),
    "units an object": (_set_top("units", {}), "units", "list"),
    "calibration samples negative": (
        lambda d: d["calibration"].__setitem__("samples", -4),
        "calibration.samples",
        ">= 1",
    ),
}


@pytest.mark.parametrize("command", ["plan", "report"])
@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_table_value_of_the_wrong_type_sign_or_finiteness_is_named(
    case, command, stand_in, tiny_nvfp4_ct, tmp_path, capsys
):
    """Found as: wrong-typed table values were tracebacks in plan hybrid and report; negative, boolean and
    fractional ones were accepted (a negative predicted error printed). One schema, one loader for both."""
    edit, row, key = BAD_TABLES[case]
    bad = _edited_table(stand_in, tmp_path / "bad", edit)
    argv = (
        [*PLAN, "--sensitivity", bad, "--dry-run"]
        if command == "plan"
        else [
            "report",
            tiny_nvfp4_ct,
            "--tp",
            "1",
            "--gpus",
            "1x80GiB",
            "--sensitivity",
            bad,
            "-o",
            tmp_path / "r.html",
        ]
    )
    refused(capsys, argv, 1, str(bad / "sensitivity.json"), row, key)
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "0", "-1", "abc", "1_0"])
def test_a_max_weights_gib_that_is_no_budget_is_a_usage_error(value, stand_in, capsys):
    """Found as: nan, inf, -inf and 1e308 were tracebacks (float -> int); -1 was planned."""
    refused(
        capsys, [*PLAN, "--sensitivity", stand_in, "--dry-run", f"--max-weights-gib={value}"], 2, "--max-weights-gib"
    )


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.5"),
        ("--gpu-memory-utilization", "nan"),
        ("--max-num-seqs", "0"),
        ("--max-num-seqs", "-2"),
        ("--max-num-seqs", "1.5"),
    ],
)
def test_target_numbers_out_of_range_are_usage_errors(flag, value, stand_in, tmp_path, capsys):
    """Found as: --gpu-memory-utilization 0 was written into a recipe whose last step failed; --max-num-seqs 0
    was planned as 1. The same flags of verify are checked by the same argparse type."""
    refused(capsys, [*PLAN, "--sensitivity", stand_in, "-o", tmp_path / "r.yaml", f"{flag}={value}"], 2, flag)
    assert not (tmp_path / "r.yaml").exists()
    refused(capsys, ["verify", tmp_path, "--tp", "1", f"{flag}={value}"], 2, flag)


def test_the_max_weights_fix_line_gives_a_value_that_then_plans(stand_in, capsys):
    """Found as: the fix added the shortfall to the weights, not to the value given (0.0012 -> "at least
    0.00148" where 0.00134 works)."""
    import re

    err = refused(
        capsys,
        [*PLAN, "--sensitivity", stand_in, "--dry-run", "--max-weights-gib", "0.0012"],
        1,
        "--max-weights-gib of at least",
    )
    suggested = re.search(r"--max-weights-gib of at least ([0-9.e-]+)", err).group(1)
    assert float(suggested) < 0.00136  # the weights themselves, rounded up: not weights + the shortfall
    capsys.readouterr()
    assert main([*PLAN, "--sensitivity", str(stand_in), "--dry-run", "--max-weights-gib", suggested]) == 0


def test_an_empty_output_path_is_a_usage_error(stand_in, tmp_path, capsys):
    """Found as: -o "" exited 0 writing nothing."""
    refused(capsys, [*PLAN, "--sensitivity", stand_in, "-o", ""], 2, "-o/--output")
    refused(capsys, [*PLAN, "--sensitivity", ""], 2, "--sensitivity")


def test_a_newline_in_the_recipe_or_table_path_still_gives_a_recipe_build_reads(stand_in, tmp_path, capsys):
    """Found as: a newline in -o or --sensitivity ended the recipe's comment line: build could not parse it."""
    import shutil

    from qtool.build_recipes import load_build_recipe

    sens = tmp_path / "sens\nx"
    shutil.copytree(stand_in, sens)
    recipe = tmp_path / "plan\nhybrid.yaml"
    capsys.readouterr()
    assert main([*PLAN, "--sensitivity", str(sens), "-o", str(recipe)]) == 0
    loaded = load_build_recipe(recipe)
    assert [s.op.value for s in loaded.steps] == ["assemble", "calibrate-kv", "patch-config", "verify"]


@pytest.mark.parametrize("flag", ["--bf16", "--quantized"])
def test_a_source_that_is_no_checkpoint_directory_is_named(flag, stand_in, tmp_path, capsys):
    """Found as: --bf16 /etc/passwd was accepted (and written into the recipe as a source)."""
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    refused(
        capsys,
        [*PLAN, "--sensitivity", stand_in, "-o", tmp_path / "r.yaml", flag, a_file],
        1,
        flag,
        str(a_file),
        "not a checkpoint directory",
    )
    (tmp_path / "empty").mkdir()
    refused(
        capsys,
        [*PLAN, "--sensitivity", stand_in, "--dry-run", flag, tmp_path / "empty"],
        1,
        flag,
        "not a checkpoint directory",
    )
    assert not (tmp_path / "r.yaml").exists()


@pytest.mark.parametrize("where", ["--sensitivity", "-o", "--quantized"])
def test_a_path_that_is_not_utf8_is_named_before_any_work(where, stand_in, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: a non-UTF-8 byte in a path was a UnicodeEncodeError when the recipe (or the report's page, or
    sensitivity's table after its whole pass) was written."""
    import os
    import shutil

    odd = os.fsdecode(b"odd\xff")
    args = {"--sensitivity": stand_in, "-o": tmp_path / "r.yaml", "--quantized": tiny_nvfp4_ct}
    copy = tmp_path / odd
    if where == "-o":
        args["-o"] = copy
    else:
        shutil.copytree(args[where], copy)
        args[where] = copy
    refused(capsys, [*PLAN, *[x for kv in args.items() for x in kv]], 2, where, "not UTF-8")
    assert not (tmp_path / "r.yaml").exists() and not (tmp_path / odd / "r.yaml").exists()


def test_report_and_sensitivity_name_a_path_that_is_not_utf8(stand_in, tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    import os
    import shutil

    odd = tmp_path / os.fsdecode(b"sens\xff")
    shutil.copytree(stand_in, odd)
    refused(
        capsys,
        ["report", tiny_nvfp4_ct, "--tp", "1", "--gpus", "1x80GiB", "--sensitivity", odd, "-o", tmp_path / "r.html"],
        2,
        "--sensitivity",
        "not UTF-8",
    )
    assert not (tmp_path / "r.html").exists()
    refused(
        capsys,
        ["sensitivity", tiny_bf16, tiny_nvfp4_ct, "-o", tmp_path / os.fsdecode(b"out\xff"), *WINDOWS, "--quiet"],
        2,
        "-o",
        "not UTF-8",
    )


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda c: c["text_config"].__setitem__("num_hidden_layers", 100_000_000), "num_hidden_layers"),
        (lambda c: c.pop("text_config"), "text_config"),
        (lambda c: c["quantization_config"]["ignore"].append("re:(["), "quantization_config.ignore"),
    ],
)
def test_a_config_the_shards_contradict_is_named_by_plan_hybrid(edit, named, stand_in, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: num_hidden_layers 10^8 ran plan hybrid away (3.3 GB after 120 s); a config without
    text_config and an ignore pattern `re:([` were tracebacks."""
    import shutil

    q = tmp_path / "q"
    shutil.copytree(tiny_nvfp4_ct, q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["text_config"].pop("layer_types", None)
    edit(cfg)
    (q / "config.json").write_text(json.dumps(cfg))
    refused(capsys, [*PLAN, "--sensitivity", stand_in, "--dry-run", "--quantized", q], 1, str(q / "config.json"), named)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_dataset_file_that_is_not_utf8_is_named(suffix, tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: a --dataset file with latin-1 bytes was a UnicodeDecodeError traceback."""
    data = tmp_path / f"latin1{suffix}"
    data.write_bytes(('{"text": "caf\xe9"}\n' if suffix == ".jsonl" else "caf\xe9 au lait\n").encode("latin-1"))
    refused(
        capsys,
        [
            "sensitivity",
            tiny_bf16,
            tiny_nvfp4_ct,
            "-o",
            tmp_path / "out",
            "--dataset",
            data,
            "--samples",
            "1",
            "--seq-len",
            "8",
            "--dry-run",
        ],
        2,
        str(data),
        "not UTF-8",
    )
