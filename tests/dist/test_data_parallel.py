"""Data parallel over calibration windows on CPU (gloo, 2 processes), as a user runs it: `--nproc 2`
gives the same bytes / statistics as one process, for quantize (NVFP4 and AWQ), calibrate-kv and eval
kld; a rank that dies ends the run on every rank with a clear error (no hang), as does a problem rank 0
finds in the planned output (exit 3), and the partial output resumes with another number of ranks to the
same bytes. torchrun's environment (WORLD_SIZE, RANK, MASTER_ADDR/PORT) is what the ranks run under, here
set by hand for the killed-rank case."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from killpoint import run_qtool
from full_model import fixture_dir

ROOT = Path(__file__).resolve().parents[2]
# 4 windows of 64 tokens, 2 windows per micro-batch: one micro-batch per rank
JOB = ["--samples", "4", "--seq-len", "64", "--batch-tokens", "128", "--quiet"]
TIMEOUT = 240  # a hang fails the test instead of the suite


def _same_output(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != "qtool-manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # the output's own path is recorded (output, work_dir): the same under another name
    ma, mb = (json.loads((d / "qtool-manifest.json").read_text().replace(str(d), "OUT")) for d in (a, b))
    for key in set(ma) | set(mb):
        if key != "command":
            assert ma.get(key) == mb.get(key), key  # per-layer statistics, files and their digests included


def _run(args, **kw):
    p = run_qtool(args, timeout=TIMEOUT, **kw)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.parametrize("recipe", ["qwen35-nvfp4-experts", "qwen35-nvfp4-experts-mse", "qwen35-awq-int4"])
def test_quantize_two_ranks_same_bytes(request, tmp_path, recipe):
    """RTN NVFP4; NVFP4 with MSE block scales; AWQ INT4: each rank codes its chunks of experts (with
    their MSE or AWQ scale search) and writes them into the one shard file."""
    src = fixture_dir(request, "tiny_bf16")
    one, two = tmp_path / "one", tmp_path / "two"
    _run(["quantize", src, "-o", one, "--recipe", recipe, "--backend", "rtn", *JOB])
    _run(["quantize", src, "-o", two, "--recipe", recipe, "--backend", "rtn", *JOB, "--nproc", "2"])
    _same_output(one, two)


HESSIAN_RECIPES = {
    # NVFP4 GPTQ with each block's scale chosen as GPTQ reaches it by local_hessian (the shipped recipe)
    "nvfp4-gptq": "qwen35-nvfp4-experts-gptq",
    # local_hessian block scales without GPTQ (their 16x16 Hessians)
    "local-hessian": "groups: {routed_experts: nvfp4}\nnvfp4: {weight_scale: local_hessian}\nkv_cache: fp8\n",
    # layers kept in BF16 between GPTQ ones: the ranks switch between every window and their share of them
    "gptq-some-layers-bf16": "groups: {routed_experts: nvfp4}\ngptq: {enabled: true}\nkv_cache: fp8\n"
    "layer_overrides: {1: {routed_experts: bf16}, 2: {routed_experts: bf16}}\n",
    # INT4 GPTQ after the AWQ search (its rows and the Hessians, of every window on every rank)
    "int4-awq-gptq": "groups: {routed_experts: w4a16}\nint4: {group_size: 32, awq: true}\ngptq: {enabled: true}\n"
    "defaults: {format: compressed-tensors}\n",
}


@pytest.mark.parametrize("method", list(HESSIAN_RECIPES))
def test_quantize_hessian_methods_two_ranks_same_bytes(request, tmp_path, method):
    """GPTQ and local_hessian sum per-expert Hessians window by window: with two ranks every rank runs every
    window and sums those of the experts it codes, so the bytes and the manifest's per-layer entries are one
    process's. Two micro-batches of 4 tokens leave experts of both ranks without a token: the layers'
    fallback lists (GPTQ's RTN experts, local_hessian's plain-MSE experts) merge every rank's. One CPU thread
    in both runs, as a rank gets on a 2-core box: the AWQ report's float means depend on torch's thread count
    (its bytes do not)."""
    src = fixture_dir(request, "tiny_bf16")
    recipe = HESSIAN_RECIPES[method]
    if ":" in recipe:
        path = tmp_path / f"{method}.yaml"
        path.write_text(f"schema_version: 1\nname: {method}\n{recipe}")
        recipe = str(path)
    job = ["--samples", "2", "--seq-len", "4", "--batch-tokens", "4", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    _run(["quantize", src, "-o", one, "--recipe", recipe, *job], env=env)
    _run(["quantize", src, "-o", two, "--recipe", recipe, *job, "--nproc", "2"], env=env)
    _same_output(one, two)
    layers = json.loads((one / "qtool-manifest.json").read_text())["layers"]
    fallback = {e for entry in layers for e in _fallback_experts(entry)}
    assert min(fallback) < 4 <= max(fallback)  # rank 0 codes experts 0-3, rank 1 experts 4-7


def _fallback_experts(entry: dict) -> list[int]:
    """A layer's experts coded without their own statistics (GPTQ: by RTN; local_hessian: by plain MSE)."""
    if "gptq" in entry:
        return entry["gptq"]["rtn_experts"]
    return entry["local_hessian"]["experts_plain_mse"] if "local_hessian" in entry else []


def test_quantize_every_token_two_ranks_same_bytes(request, tmp_path):
    """A recipe's `calibration.experts: all` (AWQ, with a token floor): each rank runs every expert on its
    windows; token counts, amaxes and the AWQ rows reduce to one process's."""
    src = fixture_dir(request, "tiny_bf16")
    recipe = tmp_path / "awq-all.yaml"
    recipe.write_text(
        "schema_version: 1\nname: awq-all\ngroups: {routed_experts: w4a16}\n"
        "defaults: {format: compressed-tensors}\ncalibration: {experts: all, min_expert_tokens: 4}\n"
    )
    one, two = tmp_path / "one", tmp_path / "two"
    _run(["quantize", src, "-o", one, "--recipe", recipe, *JOB])
    _run(["quantize", src, "-o", two, "--recipe", recipe, *JOB, "--nproc", "2"])
    _same_output(one, two)
    layers = json.loads((one / "qtool-manifest.json").read_text())["layers"]
    assert all(entry["tokens_per_expert"] == [4 * 64] * 8 for entry in layers)


def test_calibrate_kv_two_ranks_same_bytes(request, tmp_path):
    src = fixture_dir(request, "tiny_nvfp4_modelopt")
    one, two = tmp_path / "one", tmp_path / "two"
    _run(["calibrate-kv", src, "-o", one, "--replace-scales", *JOB])
    _run(["calibrate-kv", src, "-o", two, "--replace-scales", *JOB, "--nproc", "2"])
    _same_output(one, two)


def test_eval_kld_two_ranks_same_statistics(request, tmp_path):
    ref, test = fixture_dir(request, "tiny_bf16"), fixture_dir(request, "tiny_nvfp4_modelopt")
    job = [
        "eval",
        "kld",
        "--ref",
        ref,
        "--test",
        test,
        "--windows",
        "4",
        "--seq-len",
        "64",
        "--batch-tokens",
        "128",
        "--json",
        "--quiet",
    ]
    one = json.loads(_run(job).stdout)
    two = json.loads(_run([*job, "--nproc", "2"]).stdout)
    assert one == two and one["positions"] == 4 * 64  # every position of every window, in order


def test_dry_run_plans_memory_per_rank(request, tmp_path):
    src = fixture_dir(request, "tiny_nvfp4_modelopt")
    p = _run(
        ["calibrate-kv", src, "-o", tmp_path / "o", "--replace-scales", *JOB, "--nproc", "2", "--dry-run", "--json"]
    )
    need = json.loads(p.stdout)["plan"]["memory"]["need"]
    assert need["ranks"] == 2 and not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(args: list, kill_rank: int, after_layers: int, point: list[str] | None = None) -> list[subprocess.Popen]:
    """Two ranks under torchrun's environment; `kill_rank` SIGKILLs itself once it has run
    `after_layers` decoder layers, or meets `point` (tests/killpoint.py arguments)."""
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "QTOOL_DIST_TIMEOUT": "60",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    procs = []
    for r in range(2):
        e = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        if r == kill_rank:
            point = point or ["qtool.stream.layer_stream:LayerStreamer.forward_layer", str(after_layers)]
            cmd = [sys.executable, str(ROOT / "tests/killpoint.py"), *point, "--", *map(str, args)]
        else:
            cmd = [sys.executable, "-m", "qtool", *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize(
    ("kill_rank", "recipe"),
    [(1, "qwen35-nvfp4-experts"), (0, "qwen35-nvfp4-experts"), (1, "qwen35-nvfp4-experts-gptq")],
)
def test_killed_rank_stops_every_rank_and_resumes_with_another_count(request, tmp_path, kill_rank, recipe):
    src = fixture_dir(request, "tiny_bf16")
    clean, out = tmp_path / "clean", tmp_path / "out"
    args = ["quantize", src, "-o", out, "--recipe", recipe, *JOB]
    _run(["quantize", src, "-o", clean, "--recipe", recipe, *JOB])
    procs = _ranks(args, kill_rank, after_layers=3)
    t0 = time.monotonic()
    results = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert time.monotonic() - t0 < 120  # the survivor stopped on its own (the collectives' peer was gone)
    assert procs[kill_rank].returncode == -9
    survivor = procs[1 - kill_rank]
    assert survivor.returncode == 1
    err = results[1 - kill_rank][1]
    assert "lost the other ranks" in err and "--resume" in err and "Traceback" not in err
    assert not out.exists() and (out.parent / "out.partial").is_dir()
    journal = json.loads((out.parent / "out.partial/.quantize/journal.json").read_text())
    assert 1 <= journal["next_layer"] <= 3  # a partial run, not a restart
    _run([*args, "--resume"])  # one process now
    _same_output(clean, out)


def test_a_lost_rank_of_a_command_without_resume_does_not_offer_it(request, tmp_path):
    """Found in review: the survivor of a killed `eval kld` rank said "re-run with --resume", an option eval
    kld does not have (the launcher's own message already left it out)."""
    ref, test = fixture_dir(request, "tiny_bf16"), fixture_dir(request, "tiny_nvfp4_modelopt")
    job = [
        "eval",
        "kld",
        "--ref",
        ref,
        "--test",
        test,
        "--windows",
        "4",
        "--seq-len",
        "64",
        "--batch-tokens",
        "128",
        "--quiet",
    ]
    procs = _ranks(job, kill_rank=1, after_layers=2)
    results = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert procs[1].returncode == -9 and procs[0].returncode == 1
    err = results[0][1]
    assert "lost the other ranks" in err and "run the command again" in err and "--resume" not in err, err
    assert "Traceback" not in err


def test_launcher_ends_the_run_when_a_rank_dies(request, tmp_path):
    """`--nproc 2` and an outside `kill -9` of rank 1: the command exits non-zero, names the rank, and
    keeps the partial output; `--resume --nproc 2` completes it to the clean bytes."""
    src = fixture_dir(request, "tiny_bf16")
    clean, out = tmp_path / "clean", tmp_path / "out"
    job = ["quantize", src, "-o", out, "--recipe", "qwen35-nvfp4-experts", *JOB]
    _run(["quantize", src, "-o", clean, "--recipe", "qwen35-nvfp4-experts", *JOB])
    p = subprocess.Popen(
        [sys.executable, "-m", "qtool", *map(str, job), "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    journal = out.parent / "out.partial/.quantize/journal.json"
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if journal.exists() and json.loads(journal.read_text() or "{}").get("next_layer", 0) >= 1:
            break
        time.sleep(0.05)
    rank1 = _child_with_rank(p.pid, 1)
    os.kill(rank1, 9)
    _, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode != 0
    assert "rank 1 of 2 was killed by signal 9" in err and "--resume" in err
    assert not out.exists()
    _run([*job, "--resume", "--nproc", "2"])
    _same_output(clean, out)


def _child_with_rank(parent: int, rank: int) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(d.name)
    raise AssertionError(f"no rank {rank} under {parent}")


@pytest.mark.parametrize(
    "command, rank, point",
    [
        # rank 0's write of layer 2 fails while rank 1 runs on: rank 1 must not overwrite the hidden states the
        # journal still names (quantize: three files, one layer of lag)
        (
            ["quantize", "--recipe", "qwen35-nvfp4-experts"],
            0,
            ["qtool.ops.quantize.layer:write_layer_shard", "3", "ENOSPC"],
        ),
        # rank 1's share of layer 2 fails (it codes and writes half the experts): rank 0 must not name the file
        (["quantize", "--recipe", "qwen35-awq-int4"], 1, ["qtool.ops.quantize.layer:write_layer_shard", "3", "ENOSPC"]),
        # rank 0's journal write fails (calibrate-kv: two files)
        (["calibrate-kv", "--replace-scales"], 0, ["qtool.io.jsonio:write_json", "4", "ENOSPC"]),
    ],
)
def test_a_failed_write_on_a_rank_resumes_to_the_same_bytes(request, tmp_path, command, rank, point):
    src = fixture_dir(request, "tiny_bf16" if command[0] == "quantize" else "tiny_nvfp4_modelopt")
    job = [command[0], src, *command[1:], "--samples", "6", "--seq-len", "64", "--batch-tokens", "64", "--quiet"]
    clean, out = tmp_path / "clean", tmp_path / "out"
    _run([*job, "-o", clean])
    procs = _ranks([*job, "-o", out], rank, 0, point)
    results = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert procs[rank].returncode == 1 and "No space left on device" in results[rank][1]
    assert procs[1 - rank].returncode == 1
    if rank == 1:
        assert "lost the other ranks" in results[0][1]
        partial = out.parent / "out.partial"
        assert json.loads((partial / ".quantize/journal.json").read_text())["next_layer"] == 2
        assert not (partial / "model-layer-00002.safetensors").exists()  # the half-written shard was not named
    _run([*job, "-o", out, "--resume", "--nproc", "2"])
    _same_output(clean, out)


def test_launcher_shares_the_cores_out(monkeypatch):
    """N CPU ranks of torch's default thread count would each run the box's cores' threads: the launcher
    gives each cores / N (OMP_NUM_THREADS, as torchrun sets it), and a user's own setting wins."""
    from qtool.dist import launch

    seen = []

    class Exited:  # a rank that has already ended cleanly
        returncode = 0

        def __init__(self, cmd, env, stdout, **kw):
            seen.append(env)

        def poll(self):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Exited)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.spawn(["calibrate-kv", "x"], ["cpu", "cpu"]) == 0
    assert [e["OMP_NUM_THREADS"] for e in seen] == ["4", "4"]
    seen.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.spawn(["calibrate-kv", "x"], ["cpu", "cpu", "cpu"]) == 0
    assert [e["OMP_NUM_THREADS"] for e in seen] == ["3", "3", "3"]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_failing_ranks_own_error_reaches_the_user(request, tmp_path, monkeypatch, capfd, as_json):
    """Found (issue 26): under `--nproc 2`, when one rank failed the user could be left with the generic "lost
    the other ranks" and the launcher's "rank 1 ... exited with status 1 (its error is above)", and no real
    error above: with --json, a rank other than 0 printed its error as JSON to its stdout, which the launcher
    discards. Here rank 1's write of a layer fails (a full disk) under the launcher itself."""
    from qtool.cli.main import main
    from qtool.dist import launch

    src = fixture_dir(request, "tiny_bf16")
    real = launch.subprocess.Popen

    def popen(cmd, env, **kw):  # rank 1 runs under tests/killpoint.py: its 3rd layer write raises ENOSPC
        if env["RANK"] == "1":
            assert cmd[1] == "-c" and "console()" in cmd[2], cmd  # a rank: the launcher's own qtool
            cmd = [
                cmd[0],
                str(ROOT / "tests/killpoint.py"),
                "qtool.ops.quantize.layer:write_layer_shard",
                "3",
                "ENOSPC",
                "--",
                *cmd[3:],
            ]
            env = {**env, "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")}
        return real(cmd, env=env, **kw)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    args = [
        "quantize",
        str(src),
        "-o",
        str(tmp_path / "out"),
        "--recipe",
        "qwen35-nvfp4-experts",
        "--samples",
        "6",
        "--seq-len",
        "64",
        "--batch-tokens",
        "64",
        "--quiet",
        "--nproc",
        "2",
    ]
    assert main([*args, "--json"] if as_json else args) == 1
    out, err = capfd.readouterr()
    # the launcher's last line names rank 1: alone, or with rank 0 when both exits are seen at once (rank 0
    # follows within milliseconds, with "lost the other ranks")
    last = next(ln for ln in err.splitlines() if ln.startswith("qtool: rank"))
    assert "rank 1 of 2 exited with status 1" in last or "ranks 0 (status 1), 1 (status 1) of 2" in last, err
    above = err.split(last)[0]
    assert "No space left on device" in above and "model-layer-00002.safetensors" in above, err
    assert "Traceback" not in err


# rank 0 of a `--nproc 2` run with a problem planted in its planned output's structure (as
# tests/ops/test_quantize_check.py plants it in one process); its writes from the third layer on wait for the
# check to have found it, so that the run stops early however slowly the check's thread is scheduled
PLANTED = """
import importlib, sys, threading
import qtool.ops.inspect
layer = importlib.import_module("qtool.ops.quantize.layer")
from qtool.findings import Code, error
real_problems, real_write, found = qtool.ops.inspect.structure_problems, layer.write_layer_shard, threading.Event()
def planted(mm, summary):
    problems = real_problems(mm, summary) + [error(Code.MISSING_TENSOR, "model.language_model.layers.0",
                                                   "a planted problem")]
    found.set()
    return problems
def write(path, lp, *a, **k):
    if lp.index >= 2:
        assert found.wait(60)
    return real_write(path, lp, *a, **k)
qtool.ops.inspect.structure_problems, layer.write_layer_shard = planted, write
from qtool.cli.main import main
code = main(sys.argv[1:])
alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("qtool-") and t.is_alive())
if alive:
    print(f"qtool threads alive at exit: {alive}", file=sys.stderr)
sys.exit(code)
"""


def _running_with(entry: str) -> list[int]:
    """The processes (not zombies) whose environment holds `entry` (NAME=value)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if (
                d.name.isdigit()
                and entry.encode() in (d / "environ").read_bytes().split(b"\0")
                and (d / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
            ):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_a_structure_problem_stops_every_rank_at_the_next_layer(request, tmp_path, monkeypatch, capfd):
    """`--nproc 2` with a wrong plan (a qtool bug, planted on rank 0, which checks the output): the command
    exits 3 naming the problem a layer or two in, not after the last layer; every rank has ended (rank 1 on
    its own, having lost rank 0), the layer it stopped at is not journaled, and `--resume` (the bug mended)
    finishes to the bytes of a run that never stopped."""
    from qtool.cli.main import main
    from qtool.dist import launch

    src = fixture_dir(request, "tiny_bf16")
    clean, out = tmp_path / "clean", tmp_path / "out"
    job = ["quantize", str(src), "-o", str(out), "--recipe", "qwen35-nvfp4-experts", *JOB]
    _run(["quantize", src, "-o", clean, "--recipe", "qwen35-nvfp4-experts", *JOB])
    real, ranks, ports = launch.subprocess.Popen, [], set()

    def popen(cmd, env, **kw):
        if env["RANK"] == "0":
            assert cmd[1] == "-c" and "console()" in cmd[2], cmd  # a rank: the launcher's own qtool
            cmd = [cmd[0], "-c", PLANTED, *cmd[3:]]
        ports.add(env["MASTER_PORT"])
        ranks.append(real(cmd, env=env, **kw))
        return ranks[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    capfd.readouterr()
    assert main([*job, "--nproc", "2"]) == 3
    _, err = capfd.readouterr()
    assert "the planned output has 1 problem(s); stopped at" in err and "missing-tensor: a planted problem" in err
    assert "qtool threads alive at exit" not in err and "Traceback" not in err, err
    assert [p.returncode for p in ranks] == [3, 1], err  # rank 1 stopped on its own (not the launcher's SIGTERM)
    assert _running_with(f"MASTER_PORT={ports.pop()}") == []  # no rank, nor anything a rank started, runs on
    stopped = int(err.split("stopped at model-layer-")[1][:5])
    assert stopped < 7 and not out.exists()  # of the tiny model's 8 layers (0..7)
    journal = json.loads((out.parent / "out.partial/.quantize/journal.json").read_text())
    assert journal["next_layer"] == stopped  # every layer before it kept; the one it stopped at not journaled done
    monkeypatch.undo()
    rep = json.loads(_run([*job, "--resume", "--nproc", "2", "--json"]).stdout)
    assert rep["resumed_from_layer"] == stopped and rep["output"]["problems"] == []
    _same_output(clean, out)
