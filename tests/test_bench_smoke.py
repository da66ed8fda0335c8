"""benchmarks/bench_real_layers.py's CPU smoke mode (what CI can run of it; the figures are measured on the GPU
machine at real layer size and reported in the issue notes, never asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# they measure reads or memory: run one after another on one worker, not beside each other
pytestmark = pytest.mark.xdist_group("measure")


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_real_layers_smoke(tmp_path):
    out = tmp_path / "rows.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_real_layers.py"),
            "--smoke",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())
    assert [(r["job"], r["cache"] == "warm") for r in rows] == [
        ("quantize", False),
        ("calibrate-kv", False),
        ("eval-kld", False),
        ("quantize", True),
        ("calibrate-kv", True),
        ("eval-kld", True),
    ]
    for r in rows:
        assert r["loop_s"] > 0 and r["per_layer_s"] > 0 and r["peak_rss_bytes"] > 0 and r["input_bytes"] > 0
        # each job's floor: cat of its input and dd of its output, in the same run
        assert r["output_bytes"] > 0 and r["dd_s"] > 0 and r["floor_s"] >= r["cat_s"]
        # reading and writing at once on the one device, and a steady layer's share of the floor
        assert r["both_s"] > 0 and 0 < r["layer_in_bytes"] * 2 < r["input_bytes"]
        assert r["pread_s"] > 0  # the input read as the layer reader reads it (its threads)
        if r["cache"] == "cold" and r["disk_read_bytes"] is not None:  # the program's own reads, measured alone
            assert r["program_read_bytes"] is not None and r["program_read_bytes"] >= 0
        assert 0 < r["layer_floor_s"] < r["floor_s"]
        if r["job"] == "quantize":  # (eval kld's reference holds no layers; calibrate-kv's links its input's)
            assert 0 < r["layer_out_bytes"] * 2 < r["output_bytes"]
    assert "loop/floor" in p.stdout


@pytest.mark.slow
def test_bench_real_layers_scaling_rows(tmp_path):
    """The scaling table's run (`--nproc 1,2`, the AWQ job, calibrate-kv on an untimed quantize): one
    row per job and rank count, each from a run that completed."""
    import json

    out = tmp_path / "rows.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_real_layers.py"),
            "--smoke",
            "--warm-only",
            "--jobs",
            "awq,calibrate-kv",
            "--nproc",
            "1,2",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["job"], r["ranks"]) for r in rows] == [("awq", 1), ("calibrate-kv", 1), ("awq", 2), ("calibrate-kv", 2)]
    assert all(r["per_layer_s"] > 0 for r in rows)
    assert (tmp_path / "w/awq/model.safetensors.index.json").exists()


@pytest.mark.slow
def test_bench_plan_397b_executing(tmp_path):
    """bench_plan_397b's executing mode runs a job on the sparse 397B up to its first layer and stops there
    (it replaces two of qtool's functions to do so: a rename must fail here, not run 397B layers)."""
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_plan_397b.py"),
            "--workdir",
            str(tmp_path / "w"),
            "--rounds",
            "1",
            "--jobs",
            "eval-kld",
            "--executing",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    # "eval-kld  AT-LOAD s  READ s  CPU s  AT-LOAD/READ/CPU" (one round): the first layer's bytes in hand
    # no sooner than the call that takes them
    row = next(line.split() for line in p.stdout.splitlines() if line.startswith("eval-kld"))
    assert len(row) == 8 and 0 < float(row[1]) <= float(row[3]) and float(row[5]) > 0, row
    assert "at load" in p.stdout


@pytest.mark.slow
def test_bench_plan_397b_end(tmp_path):
    """bench_plan_397b's end mode runs an executing quantize of the sparse 397B whose layers are stand-ins
    (it replaces calibrate_and_write: a change of its signature must fail here) and prints the end's parts."""
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_plan_397b.py"),
            "--workdir",
            str(tmp_path / "w"),
            "--rounds",
            "1",
            "--end",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    row = next(line.split() for line in p.stdout.splitlines() if line.startswith("0 "))
    parts = dict(x.split("=") for x in row[3:])
    assert float(row[1]) > 0 and {"check_written", "commit", "rest"} <= set(parts), row


@pytest.mark.slow
def test_bench_quality_smoke(tmp_path):
    """bench_quality's smoke mode: one row per method on the trained proxy, every KLD finite and above 0
    (the methods' order is a benchmark figure, not asserted)."""
    import json
    import math

    out = tmp_path / "quality.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_quality.py"),
            "--smoke",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failed"] == [], result["failed"]
    assert [r["key"] for r in result["rows"]] == [
        "nvfp4-max",
        "nvfp4-mse",
        "nvfp4-mse-sweep",
        "nvfp4-4over6",
        "nvfp4-local-hessian",
        "nvfp4-max-gptq",
        "nvfp4-mse-sweep-gptq",
        "nvfp4-max-gptq-updated",
        "nvfp4-mse-sweep-gptq-updated",
        "nvfp4-local-hessian-gptq",
        "int4-rtn",
        "int4-awq",
        "int4-gptq",
        "int4-awq-gptq",
        "modelopt-nvfp4-max",
        "llmc-nvfp4-minmax",
        "llmc-nvfp4-mse",
        "llmc-nvfp4-gptq",
        "llmc-int4-gptq",
        "llmc-int4-awq-gptq",
        "v2-mixed",
    ]
    for r in result["rows"]:
        assert math.isfinite(r["mean_kld"]) and r["mean_kld"] > 0, r
        assert r["expert_bytes"] > 0 and r["quantize_wall_s"] > 0 and r["positions"] == 2 * 64, r
    by_key = {r["key"]: r for r in result["rows"]}
    # llm-compressor's own GPTQ stores the experts in the same bytes as qtool's rows (its NVFP4 without the
    # per-Linear FP32 input scale: weights-only NVFP4A16)
    assert by_key["llmc-int4-gptq"]["expert_bytes"] == by_key["int4-gptq"]["expert_bytes"]
    assert by_key["llmc-int4-awq-gptq"]["expert_bytes"] == by_key["int4-gptq"]["expert_bytes"]
    linears = 8 * 16 * 3  # the proxy's decoder layers x experts x projections
    assert by_key["llmc-nvfp4-gptq"]["expert_bytes"] == by_key["nvfp4-max"]["expert_bytes"] - 4 * linears
    modelopt = next(r for r in result["rows"] if r["key"] == "modelopt-nvfp4-max")
    assert modelopt["experts_identical_to_qtool_max"] is True  # ModelOpt's bytes are qtool max's
    table = [line for line in p.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(result["rows"]) and "mean KLD" in table[0]


def test_count_hessian_candidates_finds_every_winner():
    """count_hessian_candidates replays local_hessian's pruned search order on exact losses: it runs on a CPU,
    and the bounds never drop a row's winner (it exits 3 if one does)."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/count_hessian_candidates.py"), "--rows", "32", "--blocks", "4"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "winner = every candidate's: 128 of 128" in p.stdout
