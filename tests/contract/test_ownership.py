"""Issue 52: one ownership rule for every writer, build included. Each case is reproduced the way it was
found (same command, same moment, same input) and asserts what the user relies on: their files and the
artifact they had untouched, a refusal that names the path, and qtool's own clean-up finished by the next
run whatever moment a kill chose."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from in_process import run_cli
from killpoint import run_killed, start_paused
from test_output_contract import tree_sha

from qtool.cli.main import main

TIMEOUT = 600
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "build" / "demo-tiny.yaml"
WINDOWS = ["--samples", "4", "--seq-len", "32", "--batch-tokens", "64"]
SMALL = """
name: NAME
sources:
  nvfp4: {path: NV}
  bf16: {path: BF}
steps:
  - {id: hybrid, op: assemble, with: {nvfp4: nvfp4, bf16: bf16, bf16_expert_layers: [0], mtp: from-bf16}}
  - {id: patched, op: patch-config, input: hybrid, with: {fixes: [FIX]}}
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "qcache"))


def small_recipe(path: Path, name: str, nv: Path, bf: Path, fix: str = "router-ignore") -> Path:
    path.write_text(SMALL.replace("NAME", name).replace("NV", str(nv)).replace("BF", str(bf)).replace("FIX", fix))
    return path


def run_json(capsys, argv: list) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main([*map(str, argv), "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def wait_paused(proc: subprocess.Popen, marker: Path) -> None:
    deadline = time.time() + 300
    while not Path(str(marker) + ".paused").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.2)


# ---- A1: a build holds its output's lock for its whole run and publishes under the one rule ---------------


@pytest.mark.slow
def test_an_assemble_into_the_builds_output_while_it_runs_is_refused(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: `build -o X` published over the output an `assemble -o X` put at X while the build ran (both
    exit 0, no --force): the build locked X.build, not X."""
    out, marker = tmp_path / "X", tmp_path / "pause"
    build = start_paused("qtool.ops.pipeline.run:_mark", 1, marker, ["build", DEMO, "-o", out, "--quiet"])
    try:
        wait_paused(build, marker)
        p = run_cli(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                tiny_nvfp4_modelopt,
                "--bf16",
                tiny_bf16,
                "--bf16-expert-layers",
                "0",
                "-o",
                out,
                "--quiet",
            ],
            timeout=TIMEOUT,
        )
        assert p.returncode == 1 and "another qtool run" in p.stderr and str(out) in p.stderr, p.stderr
        assert not out.exists()
    finally:
        Path(str(marker) + ".go").touch()
    assert build.wait(timeout=TIMEOUT) == 0, build.communicate()
    assert json.loads((out / "qtool-manifest.json").read_text())["build"]["recipe"] == "demo-tiny"


@pytest.mark.slow
def test_a_qtool_output_put_at_the_builds_output_while_it_runs_needs_force(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """What appears at OUT during a build without taking its lock (a copy of another command's output) is
    replaced only as it would have been at the start: with --force."""
    other = tmp_path / "other"
    assert (
        run_cli(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                tiny_nvfp4_modelopt,
                "--bf16",
                tiny_bf16,
                "--bf16-expert-layers",
                "0",
                "-o",
                other,
                "--quiet",
            ],
            timeout=TIMEOUT,
        ).returncode
        == 0
    )
    out, marker = tmp_path / "X", tmp_path / "pause"
    build = start_paused("qtool.ops.pipeline.run:_mark", 1, marker, ["build", DEMO, "-o", out, "--quiet"])
    try:
        wait_paused(build, marker)
        shutil.copytree(other, out)
    finally:
        Path(str(marker) + ".go").touch()
    _, err = build.communicate(timeout=TIMEOUT)
    assert build.returncode == 1 and "--force" in err and str(out) in err and "Traceback" not in err, err
    assert tree_sha(out, skip=()) == tree_sha(other, skip=())
    # the steps are cached: the build asked again with --force publishes at once
    p = run_cli(["build", DEMO, "-o", out, "--force", "--json"], timeout=TIMEOUT)
    assert p.returncode == 0 and json.loads(p.stdout)["ran"] == [], p.stderr
    assert json.loads((out / "qtool-manifest.json").read_text())["build"]["recipe"] == "demo-tiny"


# ---- A2: a build replaces without --force only what the same recipe published there -------------------


def test_another_recipes_build_at_the_same_output_needs_force(tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path, capsys):
    """Found as: `build demo-tiny -o X`, then `build other.yaml -o X` (no --force) replaced the first artifact
    and deleted its step cache (any manifest with a `build` key passed as the build's own)."""
    first = small_recipe(tmp_path / "first.yaml", "first", tiny_nvfp4_modelopt_nomtp, tiny_bf16)
    other = small_recipe(tmp_path / "other.yaml", "other", tiny_nvfp4_modelopt_nomtp, tiny_bf16, fix="mtp-ignore")
    out = tmp_path / "X"
    rc, _ = run_json(capsys, ["build", first, "-o", out])
    assert rc == 0
    artifact, cache = tree_sha(out, skip=()), tree_sha(tmp_path / "X.build", skip=())
    rc, err = run_json(capsys, ["build", other, "-o", out])
    assert rc == 1 and "recipe 'first'" in err["message"] and "--force" in err["hint"], err
    assert tree_sha(out, skip=()) == artifact and tree_sha(tmp_path / "X.build", skip=()) == cache
    # the same recipe, edited, replaces its own artifact without --force
    small_recipe(first, "first", tiny_nvfp4_modelopt_nomtp, tiny_bf16, fix="mtp-ignore")
    rc, rep = run_json(capsys, ["build", first, "-o", out])
    assert rc == 0 and rep["published"], rep
    # and with --force the other recipe replaces it
    rc, rep = run_json(capsys, ["build", other, "-o", out, "--force"])
    assert rc == 0 and rep["published"], rep
    assert json.loads((out / "qtool-manifest.json").read_text())["build"]["recipe"] == "other"


def test_a_build_onto_another_commands_output_needs_force(tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path, capsys):
    """A qtool output that no build made (a convert's) is another command's work: --force, as for any writer."""
    out = tmp_path / "X"
    assert (
        main(["convert", str(tiny_nvfp4_modelopt_nomtp), "--to", "compressed-tensors", "-o", str(out), "--quiet"]) == 0
    )
    before = tree_sha(out, skip=())
    rec = small_recipe(tmp_path / "r.yaml", "r", tiny_nvfp4_modelopt_nomtp, tiny_bf16)
    rc, err = run_json(capsys, ["build", rec, "-o", out])
    assert rc == 1 and "qtool convert" in err["message"] and "--force" in err["hint"], err
    assert tree_sha(out, skip=()) == before and not (tmp_path / "X.build").exists()  # refused before any step
    rc, _ = run_json(capsys, ["build", rec, "-o", out, "--force"])
    assert rc == 0


# ---- A3: an output inside an input; --force never deletes what the manifest does not list --------------


@pytest.fixture(scope="module")
def sens_table(tiny_bf16, tiny_nvfp4_ct, tmp_path_factory) -> Path:
    s = tmp_path_factory.mktemp("sens") / "S"
    assert main(["sensitivity", str(tiny_bf16), str(tiny_nvfp4_ct), "-o", str(s), *WINDOWS, "--quiet"]) == 0
    return s


@pytest.mark.parametrize("given", ["dir", "json"])
def test_a_report_inside_its_sensitivity_input_is_refused(given, sens_table, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: `report -o S/r.html --sensitivity S` wrote inside its own input (plan hybrid refused the same
    path)."""
    s = tmp_path / "S"
    shutil.copytree(sens_table, s)
    before = tree_sha(s, skip=())
    table = s if given == "dir" else s / "sensitivity.json"
    for cmd in (
        ["report", tiny_nvfp4_ct, "--tp", "1", "--sensitivity", table, "-o", s / "r.html"],
        ["plan", "hybrid", "--sensitivity", table, "--tp", "1", "-o", s / "p.yaml"],
    ):
        rc, err = run_json(capsys, cmd)
        assert rc == 2 and "inside an input" in err["message"] and str(s) in err["message"], (cmd, err)
    assert tree_sha(s, skip=()) == before


@pytest.mark.slow
def test_force_never_deletes_a_file_the_manifest_does_not_list(sens_table, tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: `sensitivity -o S --force` deleted the user's S/NOTES.txt (not in S's manifest) without a
    word."""
    s = tmp_path / "S"
    shutil.copytree(sens_table, s)
    (s / "NOTES.txt").write_text("my notes")
    (s / "plots").mkdir()
    (s / "plots" / "a.png").write_bytes(b"png")
    before = tree_sha(s, skip=())
    rc, err = run_json(capsys, ["sensitivity", tiny_bf16, tiny_nvfp4_ct, "-o", s, *WINDOWS, "--force"])
    assert rc == 1 and "NOTES.txt" in err["message"] and "plots/a.png" in err["message"], err
    assert tree_sha(s, skip=()) == before and not (tmp_path / "S.partial").exists()
    # moved away, the same command replaces it
    (s / "NOTES.txt").unlink()
    shutil.rmtree(s / "plots")
    rc, _ = run_json(capsys, ["sensitivity", tiny_bf16, tiny_nvfp4_ct, "-o", s, *WINDOWS, "--force"])
    assert rc == 0


@pytest.mark.slow
def test_a_file_put_in_the_output_during_the_run_is_not_deleted_by_its_commit(tiny_nvfp4_modelopt, tmp_path):
    """The rule holds at the commit too (hours after the start, for a long run): a file the user put in the
    qtool output being replaced meanwhile stops the commit, and the finished work waits for --resume."""
    out, marker = tmp_path / "out", tmp_path / "pause"
    args = ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", out, "--quiet"]
    assert run_cli(args, timeout=TIMEOUT).returncode == 0
    proc = start_paused("qtool.io.output:OutputDir._prepare", 1, marker, [*args, "--force"])
    try:
        wait_paused(proc, marker)
        (out / "NOTES.txt").write_text("my notes")
    finally:
        Path(str(marker) + ".go").touch()
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 1 and "NOTES.txt" in err and "Traceback" not in err, err
    assert (out / "NOTES.txt").read_text() == "my notes" and (tmp_path / "out.partial").is_dir()
    (out / "NOTES.txt").unlink()
    p = run_cli([*args, "--force", "--resume"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "out.partial").exists()


# ---- E1: qtool's own clean-up, interrupted at any point, is finished by the next run ------------------


def _failing_unlink(n: int, under: Path):
    """os.unlink whose Nth call on a path under `under` fails (EIO): the removal stops there, as a kill would
    stop it. Other paths (qtool's cache, another thread's temporary files) neither count nor fail."""
    real, calls = os.unlink, [0]

    def unlink(path, *a, **k):
        if os.path.abspath(os.fspath(path)).startswith(str(under) + os.sep):
            calls[0] += 1
            if calls[0] == n:
                raise OSError(errno.EIO, "interrupted here", str(path))
        return real(path, *a, **k)

    return unlink


def _state_partial(src: Path, tmp: Path) -> tuple[Path, list]:
    """OUT.partial left by a convert killed midway; the next run (no --resume) removes it."""
    out = tmp / "out"
    args = ["convert", src, "--to", "compressed-tensors", "-o", out, "--quiet", "--force"]
    assert run_killed("qtool.io.identity:Journal.record", 2, args).returncode == -9
    return tmp / "out.partial", args


def _state_parked(src: Path, tmp: Path) -> tuple[Path, list]:
    """`.OUT.qtool-old`: a replaced output parked by a commit (marked, renamed) not yet removed."""
    out = tmp / "out"
    args = ["convert", src, "--to", "compressed-tensors", "-o", out, "--quiet", "--force"]
    assert main(list(map(str, args))) == 0
    old = tmp / ".out.qtool-old"
    shutil.copytree(out, old)
    (old / ".qtool-swapped-out").touch()
    return old, args


def _state_in_place(src: Path, tmp: Path) -> tuple[Path, list]:
    """`.CKPT.qtool-old`: a checkpoint's previous state, swapped out by an in-place run, not yet removed."""
    ck = tmp / "ck"
    shutil.copytree(src, ck)
    old = tmp / ".ck.qtool-old"
    shutil.copytree(src, old)
    (old / ".qtool-swapped-out").touch()
    return old, ["patch-config", ck, "--fix", "router-ignore", "--sampling-defaults"]


STATES = {"partial": _state_partial, "parked": _state_parked, "in-place-old": _state_in_place}


@pytest.mark.slow
@pytest.mark.parametrize("what", sorted(STATES))
def test_an_interrupted_removal_of_qtools_own_directory_is_finished_by_the_next_run(
    what, tiny_nvfp4_modelopt, tmp_path, monkeypatch
):
    """Found as: a kill while qtool removed its own OUT.partial, .OUT.qtool-old or .CKPT.qtool-old left a
    directory every later run refused as "not made by qtool" (--resume and --force too): the marker that
    says qtool made it could go first. Here the removal is stopped at each of its steps in turn."""
    (tmp_path / "state").mkdir()
    template, args = STATES[what](tiny_nvfp4_modelopt, tmp_path / "state")
    entries = sum(1 for _ in template.rglob("*"))
    for n in range(1, entries + 2):
        work = tmp_path / f"n{n}"
        shutil.copytree(tmp_path / "state", work, symlinks=True)
        target = work / template.name
        argv = [str(a).replace(str(tmp_path / "state"), str(work)) for a in args]
        with monkeypatch.context() as m:
            m.setattr(os, "unlink", _failing_unlink(n, work))
            main(argv)  # stopped midway (or not at all, where n is past the removal's last step)
        assert main(argv) == 0, (n, sorted(p.name for p in target.iterdir()) if target.exists() else None)
        assert not target.exists(), n
        shutil.rmtree(work)
