"""`qtool report`: the page's data are the objects `inspect --json`, `verify --json` and `eval kld --json`
print, the grid cells on the page say what those objects say, and bad input is refused before anything
is written."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from qtool.cli.main import main


class _Page(HTMLParser):
    """The embedded data, the grid cells (data-row/col/format/findings) and the ids of a report page."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, dict[tuple[str, str], dict]] = {}
        self.ids: list[str] = []
        self.data = None
        self.loads: list[str] = []
        self._grid = None
        self._in_data = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "table" and (a.get("id") or "").startswith("grid-") and a["id"] != "grid-difference":
            self._grid = a["id"]
            self.cells[self._grid] = {}
        if tag == "td" and self._grid and "data-row" in a:
            self.cells[self._grid][(a["data-row"], a["data-col"])] = a
        if tag == "script" and a.get("id") == "qtool-report-data":
            self._in_data = True
        for key in ("src", "href"):  # anything the page would fetch when opened
            if key in a and not (a[key] or "").startswith("#"):
                self.loads.append(a[key])
        if tag == "link":
            self.loads.append(str(a))

    def handle_endtag(self, tag):
        if tag == "table":
            self._grid = None
        if tag == "script":
            self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data = json.loads(data)


def _page(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def _json_of(capsys, argv: list[str]) -> dict:
    rc = main(argv)
    assert rc in (0, 3), rc
    return json.loads(capsys.readouterr().out)


def _cells_match_inspect(page: _Page, grid_id: str, grid: dict) -> int:
    """Every grid cell of inspect's JSON is on the page with its format; returns how many."""
    cells = page.cells[grid_id]
    want = {("model", c): cell["format"] for c, cell in grid["model"].items()}
    for r in grid["rows"]:
        want.update({(r["row"], c): cell["format"] for c, cell in r["cells"].items()})
    got = {k: a["data-format"] for k, a in cells.items() if "data-format" in a}
    assert got == want
    return len(want)


def test_tiny_report_shows_what_inspect_and_verify_print(tiny_nvfp4_modelopt, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = _page(out)
    a = page.data["artifacts"][0]
    assert a["inspect"] == _json_of(capsys, ["inspect", str(tiny_nvfp4_modelopt), "--json"])
    # its KV scales are calibrated: the report judges it with the FP8 KV cache serve-config launches it with
    assert a["verify"] == _json_of(
        capsys, ["verify", str(tiny_nvfp4_modelopt), "--tp", "2", "--kv-cache-dtype", "fp8", "--json"]
    )
    n = _cells_match_inspect(page, "grid-0", a["inspect"]["grid"])
    assert n == 8 * 4 + 5 + 3  # 8 decoder layers x 4 groups, the MTP layer's 4 + mtp.fc, embed/lm_head/vision
    # the tiny fixture's routed experts are NVFP4, everything else BF16 (the field report's layout)
    assert page.cells["grid-0"][("layer 0", "routed_experts")]["data-format"] == "nvfp4"
    assert page.cells["grid-0"][("layer 0", "attention")]["data-format"] == "bf16"
    assert page.cells["grid-0"][("model", "lm_head")]["data-format"] == "bf16"
    # KV scales, memory and capacity charts are drawn; launch commands for both engines
    assert {"chart-kv", "chart-memory", "chart-capacity"} <= set(page.ids)
    assert set(a["launch"]) == {"vllm@0.33.0", "sglang@0.5.23"}
    assert "vllm serve" in a["launch"]["vllm@0.33.0"]["command"]
    assert "sglang.launch_server" in a["launch"]["sglang@0.5.23"]["command"]
    # self-contained: nothing to fetch when opened; SVG ids unique across the charts
    assert page.loads == []
    assert len(page.ids) == len(set(page.ids))


def test_findings_are_drawn_in_the_cell_of_their_module(tiny_nvfp4_modelopt, tmp_path, capsys):
    """A quantized layer the config ignores: both engines would load its experts as BF16."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("*.layers.2.mlp.experts*")
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))
    out = tmp_path / "r.html"
    assert main(["report", str(ck), "--tp", "2", "-o", str(out)]) == 0  # written although verify fails
    capsys.readouterr()
    page = _page(out)
    a = page.data["artifacts"][0]
    assert a["verify"]["ok"] is False
    cell = page.cells["grid-0"][("layer 2", "routed_experts")]
    assert cell["data-findings"] == "2"  # one per engine
    assert "quantized-but-ignored [vllm@0.33.0]" in cell["title"]
    assert "quantized-but-ignored [sglang@0.5.23]" in cell["title"]
    assert page.cells["grid-0"][("layer 1", "routed_experts")]["data-findings"] == "0"
    # serve-config refuses it, and the page says so instead of a launch command
    assert all("refused" in v for v in a["launch"].values())


@pytest.mark.slow
def test_report_with_saved_kld_and_with_ref(tiny_bf16, tiny_nvfp4_modelopt, tmp_path, capsys):
    window = ["--windows", "2", "--seq-len", "16"]
    kld = _json_of(
        capsys,
        ["eval", "kld", "--ref", str(tiny_bf16), "--test", str(tiny_nvfp4_modelopt), *window, "--json", "--quiet"],
    )
    assert sum(kld["histogram"]["counts"]) + kld["histogram"]["below"] + kld["histogram"]["above"] == kld["positions"]
    assert kld["per_position"]["position"] == list(range(16))
    saved = tmp_path / "kld.json"
    saved.write_text(json.dumps(kld))
    out = tmp_path / "saved.html"
    assert main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "--kld", str(saved), "-o", str(out)]) == 0
    page = _page(out)
    assert page.data["artifacts"][0]["kld"] == kld
    assert {"kld", "chart-kld-histogram", "chart-kld-position"} <= set(page.ids)
    # --ref runs the same eval kld in the report: the same numbers
    out2 = tmp_path / "ref.html"
    assert (
        main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "--ref", str(tiny_bf16), *window, "-o", str(out2)]) == 0
    )
    assert _page(out2).data["artifacts"][0]["kld"] == kld


@pytest.mark.slow
def test_two_397b_artifacts_compared(tmp_path_factory, tmp_path, capsys):
    """The sparse real-scale 397B layout, NVIDIA's NVFP4 against the BF16 original: the grid difference is
    the routed experts of all 60 layers, the BF16 one does not fit 4 x 96 GB."""
    from qtool.fixtures.sparse import build_sparse

    root = tmp_path_factory.mktemp("s397r")
    nv = build_sparse(root / "nvfp4", model="397b", flavour="modelopt-nvfp4")
    bf = build_sparse(root / "bf16", model="397b", flavour="bf16-fused")
    out = tmp_path / "cmp.html"
    assert main(["report", str(nv), str(bf), "-o", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] == [True, False] and "difference" in res["sections"]
    page = _page(out)
    a, b = page.data["artifacts"]
    assert a["verify"] == _json_of(capsys, ["verify", str(nv), "--kv-cache-dtype", "fp8", "--json"])  # calibrated
    assert b["inspect"]["grid"] == _json_of(capsys, ["inspect", str(bf), "--json"])["grid"]
    assert _cells_match_inspect(page, "grid-0", a["inspect"]["grid"]) == 60 * 4 + 5 + 3
    _cells_match_inspect(page, "grid-1", b["inspect"]["grid"])
    diff = page.data["difference"]
    assert {"rows": "layers 0-59", "column": "routed_experts", "a": "nvfp4", "b": "bf16", "cells": 60} in diff
    assert [d for d in diff if d["rows"] == "layers 0-59"] == [diff[0]]
    # the BF16 model's does-not-fit has no module: listed beside the grid
    codes = [b["verify"]["findings"][i]["code"] for i in b["marks"]["elsewhere"]]
    assert "does-not-fit" in codes
    fit = a["verify"]["fit"]
    assert fit["fits"] and sum(fit["usage_gib"].values()) == pytest.approx(fit["budget_gib"], abs=0.01)
    caps = {p["max_model_len"]: p["max_num_seqs"] for p in fit["capacity"]}
    assert caps[262144] == fit["max_num_seqs"] and caps[4096] > caps[262144]
    # 60 layers' KV scales exist in the NVFP4 layout: 15 full-attention layers, k and v each
    assert [v["layer"] for v in a["inspect"]["kv_scales"]["values"]] == a["inspect"]["full_attention_layers"]


def test_bad_input_is_refused_before_writing(tiny_nvfp4_modelopt, tmp_path, capsys):
    ck = str(tiny_nvfp4_modelopt)
    notes = tmp_path / "notes.html"
    notes.write_text("<p>my notes</p>")
    assert main(["report", ck, "-o", str(notes), "--force"]) == 1  # not a qtool report: kept, even with --force
    assert "not written by qtool" in capsys.readouterr().err and notes.read_text() == "<p>my notes</p>"
    assert main(["report", ck, "-o", str(tmp_path / "r.txt")]) == 2
    assert ".html" in capsys.readouterr().err
    assert main(["report", ck, "--kld", "a.json", "--kld", "b.json", "-o", str(tmp_path / "r.html")]) == 2
    assert "one --kld" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["report", ck, "--kld", str(bad), "-o", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "eval kld" in err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"mean": 0.1, "positions": 3}))  # an older eval kld's output
    assert main(["report", ck, "--kld", str(old), "-o", str(tmp_path / "r.html")]) == 1
    assert "histogram" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing"), "-o", str(tmp_path / "r.html")]) == 1
    assert not (tmp_path / "r.html").exists()
    # a report qtool wrote is replaced with --force (the one output contract: as for directories)
    out = tmp_path / "r.html"
    assert main(["report", ck, "--tp", "2", "-o", str(out)]) == 0
    assert main(["report", ck, "--tp", "1", "-o", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["report", ck, "--tp", "1", "-o", str(out), "--force"]) == 0
    assert _page(out).data["options"]["tp"] == 1


def test_report_of_an_hf_source_reads_headers_only(hub, tiny_nvfp4_modelopt, tmp_path, capsys):
    commit = hub.add_dir("org/nv", tiny_nvfp4_modelopt)
    out = tmp_path / "hub.html"
    assert main(["report", f"hf:org/nv@{commit}", "--tp", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    a = _page(out).data["artifacts"][0]
    assert a["label"] == f"hf:org/nv@{commit}"
    assert a["inspect"]["grid"] == _json_of(capsys, ["inspect", str(tiny_nvfp4_modelopt), "--json"])["grid"]
    assert a["verify"]["path"] == f"hf:org/nv@{commit}"  # named by the source, not qtool's header cache


def _chromium() -> str | None:
    import os

    return os.environ.get("QTOOL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
def test_page_renders_in_headless_chromium(tiny_nvfp4_modelopt, tmp_path, capsys):
    """Opened as a person would (headless Chromium, no network): the screenshot has the page's size,
    and the grid's NVFP4 green, the verdict and the charts are drawn."""
    import subprocess

    from PIL import Image

    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium (apt-get install chromium, or set QTOOL_CHROMIUM)")
    out = tmp_path / "r.html"
    assert main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "-o", str(out)]) == 0
    shot = tmp_path / "r.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,1800",
            f"--screenshot={shot}",
            out.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1800)
    px = img.load()

    def share(box, colour, tol=24) -> float:
        x0, y0, x1, y1 = box
        n = hit = 0
        for y in range(y0, y1, 2):
            for x in range(x0, x1, 2):
                n += 1
                hit += all(abs(a - b) <= tol for a, b in zip(px[x, y], colour, strict=True))
        return hit / n

    whole = (0, 0, 1200, 1800)
    assert share(whole, (255, 255, 255), tol=3) < 0.95  # not a blank page
    green = (0x2E, 0x9E, 0x5B)  # charts.FORMAT_COLOURS["nvfp4"]: the routed-experts column, the ok badge
    assert share((0, 0, 1200, 700), green) > 0.002
    grey = (0x9A, 0xA5, 0xB1)  # bf16 cells
    assert share((0, 0, 1200, 700), grey) > 0.01
    blue = (0x3D, 0x6F, 0xB6)  # k_scale bars and the weights segment
    assert share(whole, blue) > 0.001


# ---- found by the review (a helper using the command as a new user) --------------------------------


def test_review_findings_kv_dtype_mtp_and_broken_inputs(
    tiny_nvfp4_modelopt, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys
):
    # the launch command uses the KV-cache dtype the memory fit assumed (it said fp8 while the fit was BF16),
    # and (issue 26) the one serve-config chooses for the same flags: fp8 where the scales are calibrated
    out = tmp_path / "r.html"
    assert main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "-o", str(out)]) == 0
    a = _page(out).data["artifacts"][0]
    assert a["verify"]["fit"]["kv_cache_dtype"] == "fp8"
    capsys.readouterr()
    assert main(["serve-config", str(tiny_nvfp4_modelopt), "--tp", "2", "--engine", "vllm@0.33.0"]) == 0
    assert a["launch"]["vllm@0.33.0"]["command"].strip() == capsys.readouterr().out.strip()
    assert "--kv-cache-dtype fp8" in a["launch"]["vllm@0.33.0"]["command"]
    assert (
        main(["report", str(tiny_nvfp4_modelopt), "--tp", "2", "--kv-cache-dtype", "auto", "-o", str(out), "--force"])
        == 0
    )
    a = _page(out).data["artifacts"][0]
    assert a["verify"]["fit"]["kv_cache_dtype"] == "auto"
    assert "--kv-cache-dtype" not in a["launch"]["vllm@0.33.0"]["command"]
    # a finding whose row the grid does not draw (no MTP head, --mtp 1) is listed beside the grid
    assert main(["report", str(tiny_nvfp4_modelopt_nomtp), "--tp", "2", "--mtp", "1", "-o", str(out), "--force"]) == 0
    a = _page(out).data["artifacts"][0]
    codes = [a["verify"]["findings"][i]["code"] for i in a["marks"]["elsewhere"]]
    assert "mtp-missing" in codes and not a["verify"]["ok"]
    # a manifest that is not a JSON object, and a --kld file with a null statistic: named errors, no traceback
    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    (ck / "qtool-manifest.json").write_text("[1, 2]")
    capsys.readouterr()
    assert main(["report", str(ck), "--tp", "2", "-o", str(out), "--force"]) == 0
    assert "not a readable qtool manifest" in _page(out).data["artifacts"][0]["provenance"]["error"]
    kld = tmp_path / "k.json"
    kld.write_text(
        json.dumps(
            {
                "mean": None,
                "median": 0,
                "p95": 0,
                "p99": 0,
                "max": 0,
                "top1_agreement": 1,
                "positions": 1,
                "histogram": {},
                "per_position": None,
            }
        )
    )
    assert main(["report", str(ck), "--kld", str(kld), "-o", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert "wrong type: mean, histogram" in err and str(kld) in err
    # window flags without --ref would be ignored: refused; an unwritable output directory before any work
    assert main(["report", str(ck), "--windows", "8", "-o", str(out), "--force"]) == 2
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if os.access(ro, os.W_OK):  # root ignores the mode bits: nothing to test here
            return
        assert main(["report", str(ck), "-o", str(ro / "r.html")]) == 1
        assert "not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


@pytest.mark.slow
def test_report_ref_on_an_hf_source_uses_its_data(hub, tiny_bf16, tiny_nvfp4_modelopt, tmp_path, capsys):
    """Found as: `report hf:... --ref REF` ran eval kld on the header-only stand-in (zeros for data) and
    drew a made-up KLD. The source is downloaded for --ref; the op refuses a stand-in outright."""
    from qtool.errors import UsageError
    from qtool.ops import report
    from qtool.ops.report.data import Artifact
    from qtool.ops.verify import VerifyOptions

    commit = hub.add_dir("org/nv", tiny_nvfp4_modelopt)
    window = ["--windows", "1", "--seq-len", "8"]
    local = _json_of(
        capsys,
        ["eval", "kld", "--ref", str(tiny_bf16), "--test", str(tiny_nvfp4_modelopt), *window, "--json", "--quiet"],
    )
    out = tmp_path / "hub.html"
    assert main(["report", f"hf:org/nv@{commit}", "--tp", "2", "--ref", str(tiny_bf16), *window, "-o", str(out)]) == 0
    capsys.readouterr()
    assert _page(out).data["artifacts"][0]["kld"] == local
    from qtool.cli.sources import headers_checkpoint

    stand_in = headers_checkpoint(f"hf:org/nv@{commit}")
    opts = report.ReportOptions(
        (Artifact(Path(stand_in), "hf:org/nv"),), tmp_path / "x.html", VerifyOptions(tp=2), ref=str(tiny_bf16)
    )
    with pytest.raises(UsageError, match="header-only"):
        report.plan(opts)


def test_the_kv_legend_stays_off_the_bars(tiny_nvfp4_modelopt):
    """Issue 26, found as: the KV-scale chart's legend covered the bars."""
    from qtool.ops.inspect import inspect_checkpoint
    from qtool.ops.report.charts import kv_scales_figure

    kv = inspect_checkpoint(tiny_nvfp4_modelopt)["kv_scales"]
    fig = kv_scales_figure([("a", kv), ("b", kv)])
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    bars = [p.get_window_extent() for p in ax.patches]
    assert bars and not any(legend.overlaps(b) for b in bars)


def test_header_provenance_of_a_build(tiny_bf16, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys):
    """Issue 26, found as: at TP=1 the header said "TP=1 on 4x97887MiB" over one GPU's bars, and a build's
    provenance named `demo-out.build/steps/kv-...` instead of the recipe's sources."""
    out = tmp_path / "demo-out"
    assert (
        main(
            [
                "build",
                "demo-tiny",
                "-o",
                str(out),
                "--source",
                f"nvfp4={tiny_nvfp4_modelopt_nomtp}",
                "--source",
                f"bf16={tiny_bf16}",
                "--quiet",
            ]
        )
        == 0
    )
    page = tmp_path / "r.html"
    assert main(["report", str(out), "--tp", "1", "-o", str(page)]) == 0
    text = page.read_text()
    assert "TP=1: 1 GPU(s) of\n97887 MiB (of the 4x97887MiB given)" in text
    prov = _page(page).data["artifacts"][0]["provenance"]
    where = {s["name"]: s["path"] for s in prov["sources"]}
    assert where == {
        "nvfp4": f"{tiny_nvfp4_modelopt_nomtp} (--source, for the recipe's builtin tiny-nvfp4-modelopt-nomtp)",
        "bf16": f"{tiny_bf16} (--source, for the recipe's builtin tiny-bf16)",
    }
    assert ".build/steps/" not in json.dumps(prov["sources"])


def test_report_shows_each_layers_calibration_tokens_per_expert(tiny_bf16, calib_ids, tmp_path, capsys):
    """A quantize on a short calibration text: some routed experts see no token. The page's table gives,
    per layer, the min / median / max tokens and how many experts saw none, exactly from the counts the
    quantize recorded in its manifest."""
    from qtool.ops.quantize import run
    from qtool.recipes import load_recipe

    out = tmp_path / "q"
    run(tiny_bf16, out=out, recipe=load_recipe("qwen35-nvfp4-experts"), calib_ids=calib_ids[:1, :4])
    layers = json.loads((out / "qtool-manifest.json").read_text())["layers"]
    page_path = tmp_path / "r.html"
    assert main(["report", str(out), "--tp", "1", "-o", str(page_path)]) == 0
    capsys.readouterr()
    page = _page(page_path)
    rows = page.data["artifacts"][0]["expert_coverage"]
    assert [r["layer"] for r in rows] == [entry["layer"] for entry in layers]
    for row, entry in zip(rows, layers, strict=True):
        tokens = sorted(entry["tokens_per_expert"])
        assert (row["min"], row["max"], row["experts"]) == (tokens[0], tokens[-1], len(tokens))
        assert row["median"] == (tokens[3] + tokens[4]) / 2  # 8 experts
        assert row["without_tokens"] == entry["experts_without_tokens"]
    # 4 tokens x top-4 of 8 experts: at least one expert of some layer saw none, and the page marks it
    assert any(r["without_tokens"] for r in rows)
    html = page_path.read_text(encoding="utf-8")
    assert "Calibration tokens per routed expert" in html
    assert html.count('<tr data-layer="') == len(layers)


def test_report_of_a_checkpoint_qtool_did_not_quantize_has_no_token_table(tiny_nvfp4_modelopt, tmp_path, capsys):
    page_path = tmp_path / "r.html"
    assert main(["report", str(tiny_nvfp4_modelopt), "--tp", "1", "-o", str(page_path)]) == 0
    capsys.readouterr()
    assert _page(page_path).data["artifacts"][0]["expert_coverage"] is None
    assert "Calibration tokens per routed expert" not in page_path.read_text(encoding="utf-8")


def test_report_of_a_builds_artifact_shows_its_quantize_steps_tokens(tmp_path, capsys):
    """A build that quantizes and then calibrates the KV scales: the artifact's own manifest is
    calibrate-kv's, and the token counts come from the build's record of its quantize step."""
    recipe = tmp_path / "b.yaml"
    recipe.write_text(
        "name: coverage\nsources:\n  bf16: {builtin: tiny-bf16}\nsteps:\n"
        "  - {id: q, op: quantize, input: bf16, with: {recipe: qwen35-nvfp4-experts, samples: 1, seq_len: 8}}\n"
        "  - {id: kv, op: calibrate-kv, input: q, with: {samples: 1, seq_len: 8, replace_scales: true}}\n"
    )
    out = tmp_path / "out"
    assert main(["build", str(recipe), "-o", str(out)]) == 0
    capsys.readouterr()
    steps = json.loads((out / "qtool-manifest.json").read_text())["run"]["steps"]
    layers = next(s["report"]["layers"] for s in steps if s["id"] == "q")
    page_path = tmp_path / "r.html"
    assert main(["report", str(out), "--tp", "1", "-o", str(page_path)]) == 0
    capsys.readouterr()
    rows = _page(page_path).data["artifacts"][0]["expert_coverage"]
    assert [(r["layer"], r["min"], r["max"]) for r in rows] == [
        (e["layer"], min(e["tokens_per_expert"]), max(e["tokens_per_expert"])) for e in layers
    ]
