"""A newcomer's first hour (issue 26): each failure found by trying qtool as a new user, reproduced the way
it was found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _qtool(args, *, cwd, env=None, hide=(), timeout=600):
    """`qtool ARGS` in a process of its own, with the modules in `hide` uninstalled (as a plain wheel's
    install, without the extras, leaves them)."""
    boot = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in hide)
        + ("from qtool.cli.main import console\nsys.argv = ['qtool', *sys.argv[1:]]\nconsole()\n")
    )
    return subprocess.run(
        [sys.executable, "-c", boot, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=timeout,
    )


def test_the_demo_without_modelopt_names_the_extra_and_leaves_nothing_behind(tmp_path):
    """Found: a wheel installed with its declared dependencies ran `qtool build demo-tiny` into
    `ModuleNotFoundError: No module named 'modelopt'`, leaving a `.partial` and a lock in the cache."""
    cache = tmp_path / "cache"
    r = _qtool(
        ["build", "demo-tiny", "-o", "demo-out"], cwd=tmp_path, env={"QTOOL_CACHE_DIR": str(cache)}, hide=("modelopt",)
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "nvidia-modelopt" in r.stderr and "pip install 'qtool[quant]'" in r.stderr
    left = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name.endswith((".partial", ".lock"))]
    assert left == []
    assert not (tmp_path / "demo-out").exists()


def test_the_modelopt_backend_without_modelopt_is_a_named_error(tiny_bf16, tmp_path):
    r = _qtool(
        [
            "quantize",
            str(tiny_bf16),
            "-o",
            "q",
            "--recipe",
            "qwen35-nvfp4-experts",
            "--backend",
            "modelopt",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--json",
        ],
        cwd=tmp_path,
        hide=("modelopt",),
    )
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout or r.stderr)
    assert "qtool[quant]" in err["hint"]
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def _wait_for(path: Path, proc, seconds: float = 120) -> None:
    import time

    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < seconds, f"{path} did not appear"
        time.sleep(0.05)


def test_build_tells_each_step_as_it_starts_and_ends(tmp_path, tiny_bf16, tiny_nvfp4_modelopt_nomtp):
    """Found: `qtool build` showed nothing for ~15 s, then every step line at once (at the end)."""
    marker = tmp_path / "m"
    from killpoint import start_paused

    # paused inside the second step (calibrate-kv journals its first layer): the first step's lines are out
    p = start_paused(
        "qtool.ops.pipeline.run:_mark",
        1,
        marker,
        [
            "build",
            "demo-tiny",
            "-o",
            tmp_path / "out",
            "--source",
            f"nvfp4={tiny_nvfp4_modelopt_nomtp}",
            "--source",
            f"bf16={tiny_bf16}",
        ],
    )
    try:
        _wait_for(Path(str(marker) + ".paused"), p)
    finally:
        Path(str(marker) + ".go").touch()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    lines = err.splitlines()
    assert lines.index("step hybrid (assemble): running") < lines.index("step kv (calibrate-kv): running")
    assert any(x.startswith("step hybrid (assemble): done in ") for x in lines)
    assert "published: " in out


def test_ctrl_c_names_the_step_what_was_kept_and_the_command_that_continues(
    tmp_path, tiny_bf16, tiny_nvfp4_modelopt_nomtp
):
    """Found: Ctrl-C during `qtool build` printed only `interrupted`: no step, no word of the kept partial or
    of --resume."""
    import shlex

    args = [
        "build",
        "demo-tiny",
        "-o",
        str(tmp_path / "out"),
        "--source",
        f"nvfp4={tiny_nvfp4_modelopt_nomtp}",
        "--source",
        f"bf16={tiny_bf16}",
    ]
    # Ctrl-C right after the first step's first shard is on record
    err = _ctrl_c(args, "qtool.io.identity:Journal.record", 1, tmp_path / "m")
    assert "interrupted during step hybrid (assemble)" in err
    kept = [ln.split("kept:", 1)[1].split(" (")[0].strip() for ln in err.splitlines() if "kept:" in ln]
    assert kept and all(Path(k).is_dir() and k.endswith(".partial") for k in kept), err
    again = next(ln.split("continue:", 1)[1].strip() for ln in err.splitlines() if "continue:" in ln)
    argv = shlex.split(again)
    assert argv[0] == "qtool" and argv[-1] == "--resume" and argv[1:-1] == args
    r = subprocess.run(
        [sys.executable, "-m", "qtool", *argv[1:]],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "published:" in r.stdout and (tmp_path / "out" / "qtool-manifest.json").exists()


@pytest.mark.slow
def test_a_rerun_without_resume_says_it_starts_over(tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found: re-running calibrate-kv without --resume after an interruption silently started over."""
    from killpoint import run_killed

    args = [
        "calibrate-kv",
        str(tiny_nvfp4_modelopt_nomtp),
        "-o",
        str(tmp_path / "kv"),
        "--replace-scales",
        "--samples",
        "2",
        "--seq-len",
        "16",
    ]
    k = run_killed("qtool.io.identity:Journal.record", 2, args)
    assert k.returncode == -9 and (tmp_path / "kv.partial").is_dir()
    r = _qtool(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"starting over: {tmp_path / 'kv.partial'}" in r.stderr and "--resume" in r.stderr


def test_a_checkpoint_without_tokenizer_files_names_the_missing_tokenizer(tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found: it gave "the dataset gives 0 tokens ... fix: --seq-len 0 at most"."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_modelopt_nomtp, ck)
    for f in ck.glob("tokenizer*"):
        f.unlink()
    r = _qtool(["calibrate-kv", str(ck), "-o", str(tmp_path / "kv"), "--replace-scales", "--dry-run"], cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "no tokenizer" in r.stderr and "tokenizer.json" in r.stderr and "0 tokens" not in r.stderr


def test_quantize_with_its_defaults_plans_on_the_builtin_corpus(tiny_bf16, tmp_path):
    """Found: `quantize --dry-run` with its own defaults (16 x 512) failed on the builtin corpus (5804 tokens
    with the Qwen3.5 tokenizer); now the default takes the windows the corpus gives and says what a real run
    uses."""
    r = _qtool(
        [
            "quantize",
            str(tiny_bf16),
            "-o",
            str(tmp_path / "q"),
            "--recipe",
            "qwen35-nvfp4-experts",
            "--dry-run",
            "--json",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout)["plan"]
    c = plan["calibration"]
    assert c["dataset"] == "builtin" and c["seq_len"] == 512 and 1 <= c["samples"] < 16
    assert c["samples"] == c["available_tokens"] // 512
    assert any("ultrachat_200k" in w for w in plan["warnings"])
    explicit = _qtool(
        [
            "quantize",
            str(tiny_bf16),
            "-o",
            str(tmp_path / "q"),
            "--recipe",
            "qwen35-nvfp4-experts",
            "--samples",
            "16",
            "--dry-run",
        ],
        cwd=tmp_path,
    )
    assert explicit.returncode == 1 and "needed for 16 x 512" in explicit.stderr  # what was asked for, exactly


def test_inspect_never_prints_none_as_a_format(tiny_nvfp4_modelopt, tmp_path):
    """Found: `inspect` printed `None` as the format of the norms and the KV scales."""
    r = _qtool(["inspect", str(tiny_nvfp4_modelopt)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    groups = r.stdout.split("groups:")[1].split("problems:")[0]
    assert "None" not in groups
    assert any(ln.split()[:2] == ["kv_scale", "f32"] for ln in groups.splitlines() if ln.strip())


def test_assemble_says_when_the_shared_experts_it_splices_are_bf16_already(
    tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path
):
    """Found: the assemble plan said "removed 180 NVFP4 tensors" for shared experts that are BF16 in the NVFP4
    input, with no word that the splice swaps BF16 for BF16."""
    r = _qtool(
        [
            "assemble",
            "hybrid",
            "--nvfp4",
            str(tiny_nvfp4_modelopt_nomtp),
            "--bf16",
            str(tiny_bf16),
            "-o",
            str(tmp_path / "h"),
            "--bf16-expert-layers",
            "0",
            "--dry-run",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "NVFP4 tensors" not in r.stdout
    replaced = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("replaced"))
    # layer 0's routed experts were NVFP4 (8 experts x 3 projections x 4 tensors); the 8 layers' shared experts
    # (3 projections each) were BF16 already
    assert "(96 quantized, 24 BF16 already)" in replaced
    assert "shared experts are BF16 already" in r.stdout


def test_an_environment_without_orjson_still_writes_and_replaces_outputs(
    tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path
):
    """Found on the GPU machine (its image has no orjson): the bench's second quantize --force into an
    existing output died in an `import orjson`; the other JSON readers fall back to the standard library."""
    args = [
        "assemble",
        "hybrid",
        "--nvfp4",
        str(tiny_nvfp4_modelopt_nomtp),
        "--bf16",
        str(tiny_bf16),
        "-o",
        str(tmp_path / "h"),
        "--bf16-expert-layers",
        "0",
        "--quiet",
    ]
    first = _qtool(args, cwd=tmp_path, hide=("orjson",))
    assert first.returncode == 0, first.stderr
    again = _qtool([*args, "--force"], cwd=tmp_path, hide=("orjson",))
    assert again.returncode == 0, again.stderr
    with_orjson = _qtool([*args[:-3], "-o", str(tmp_path / "h2"), "--bf16-expert-layers", "0", "--quiet"], cwd=tmp_path)
    assert with_orjson.returncode == 0, with_orjson.stderr
    man = [json.loads((tmp_path / d / "qtool-manifest.json").read_text()) for d in ("h", "h2")]
    assert man[0]["shards"] == json.loads(
        json.dumps(man[1]["shards"]).replace(str(tmp_path / "h2"), str(tmp_path / "h"))
    )


def _ctrl_c(args: list[str], at: str, n: int, marker: Path) -> str:
    """stderr of `qtool ARGS` given Ctrl-C (SIGINT) right after the Nth return of `at` (exit 130 checked)."""
    import signal

    from killpoint import start_paused

    p = start_paused(at, n, marker, args)
    try:
        _wait_for(Path(str(marker) + ".paused"), p)
        p.send_signal(signal.SIGINT)
    finally:
        Path(str(marker) + ".go").touch()
    _out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    return err


def test_ctrl_c_while_qtool_makes_a_cache_promises_nothing_of_it(tmp_path, monkeypatch):
    """Found: Ctrl-C while `build demo-tiny` made its builtin tiny-bf16 listed the cache's half-made
    `bf16.partial` as "kept: ... (the work finished so far)" with a `--resume` line; but a cache is made
    again from the start by the next run, --resume or not. Only what a --resume re-run continues is kept."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(cache))  # (the child's environment)
    err = _ctrl_c(
        ["build", "demo-tiny", "-o", str(tmp_path / "out")], "qtool.fixtures.bf16:_init_model", 1, tmp_path / "m"
    )
    assert "interrupted" in err and "making the builtin tiny-bf16" in err, err
    assert list(cache.rglob("bf16.partial")), "the pause was not inside the fixture's transaction"
    assert "kept:" not in err and "continue:" not in err, err


def test_ctrl_c_with_a_token_gives_a_continue_line_that_runs(tmp_path, tiny_bf16, tiny_nvfp4_modelopt_nomtp):
    """Found: the `continue:` line after Ctrl-C of a run given `--token` said `--token '***'` (secrets never
    reach output), a command that fails on the Hub if pasted. The token is left out of it, and the user is
    told to give it again."""
    import shlex

    from qtool.cli.main import build_parser

    token = "hf_" + "x" * 20  # shaped like a real one
    args = [
        "build",
        "demo-tiny",
        "-o",
        str(tmp_path / "out"),
        "--token",
        token,
        "--source",
        f"nvfp4={tiny_nvfp4_modelopt_nomtp}",
        "--source",
        f"bf16={tiny_bf16}",
    ]
    err = _ctrl_c(args, "qtool.io.identity:Journal.record", 1, tmp_path / "m")
    assert token not in err and "***" not in err, err
    again = next(ln.split("continue:", 1)[1].strip() for ln in err.splitlines() if "continue:" in ln)
    argv = shlex.split(again)
    assert argv[1:] == [*args[:4], *args[6:], "--resume"], again
    build_parser("build").parse_args(argv[1:])
    assert "HF_TOKEN" in err and "--token" in err.split("continue:", 1)[1], err


@pytest.mark.parametrize("case", ["foreign-output", "missing-extra", "format"])
def test_quantize_refuses_a_wrong_flag_before_reading_the_dataset(case, tiny_bf16, tmp_path):
    """Found: `quantize` without --samples read (and with hf: downloaded) its dataset to plan the windows,
    and only then refused a wrong flag. Every refusal that needs no data comes first: here the dataset is a
    file that does not exist, so reading it would give its own error instead of the refusal."""
    args = ["quantize", str(tiny_bf16), "-o", "q", "--recipe", "qwen35-nvfp4-experts", "--dataset", "missing.txt"]
    hide: tuple[str, ...] = ()
    if case == "foreign-output":
        (tmp_path / "q").mkdir()
        (tmp_path / "q" / "notes.txt").write_text("a user's own")
        want = "was not made by qtool"
    elif case == "missing-extra":
        args += ["--backend", "modelopt"]
        hide, want = ("modelopt",), "qtool[quant]"
    else:
        args += ["--format", "awq"]
        want = "--format awq cannot hold nvfp4"
    r = _qtool(args, cwd=tmp_path, hide=hide)
    assert r.returncode in (1, 2), r.stderr
    assert want in r.stderr and "dataset" not in r.stderr, r.stderr
    assert (tmp_path / "q" / "notes.txt").exists() if case == "foreign-output" else not (tmp_path / "q").exists()


def test_calibrate_kv_refuses_a_users_own_output_before_reading_the_dataset(tiny_nvfp4_modelopt, tmp_path):
    """Found by the review (as quantize's): calibrate-kv read its dataset before it looked at -o."""
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "notes.txt").write_text("a user's own")
    r = _qtool(
        ["calibrate-kv", str(tiny_nvfp4_modelopt), "-o", "kv", "--replace-scales", "--dataset", "missing.txt"],
        cwd=tmp_path,
    )
    assert r.returncode in (1, 2), r.stderr
    assert "was not made by qtool" in r.stderr and "dataset" not in r.stderr, r.stderr
    assert (tmp_path / "kv" / "notes.txt").read_text() == "a user's own"


def test_report_and_serve_config_verify_a_calibrated_artifact_once(tiny_nvfp4_modelopt, tmp_path, monkeypatch, capsys):
    """Found: `report` (and `serve-config`) of an artifact with calibrated KV scales ran verify twice: once with
    the auto KV cache to learn that the scales are calibrated, then again with FP8. Verify now decides the
    served KV-cache dtype itself; the page and the launch line are what they were."""
    import re

    import qtool.ops.verify as verify_op
    from qtool.cli.main import main

    calls = []
    real = verify_op.execute

    def counted(p):
        calls.append(p.options.engine)
        return real(p)

    monkeypatch.setattr(verify_op, "execute", counted)
    flags = ["--tp", "2", "--engine", "vllm@0.33.0"]
    out = tmp_path / "r.html"
    assert main(["report", str(tiny_nvfp4_modelopt), *flags, "-o", str(out)]) == 0
    assert len(calls) == 2, calls  # the page's verify, and the launch line's (serve-config's own)
    html = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script[^>]*id="qtool-report-data"[^>]*>(.*?)</script>', html, re.S).group(1))
    a = data["artifacts"][0]
    capsys.readouterr()
    calls.clear()
    assert main(["serve-config", str(tiny_nvfp4_modelopt), *flags]) == 0
    assert len(calls) == 1, calls
    launch = capsys.readouterr().out
    assert main(["verify", str(tiny_nvfp4_modelopt), *flags, "--kv-cache-dtype", "fp8", "--json"]) == 0
    # the page judges it with the FP8 KV cache serve-config launches it with, as before
    assert a["verify"] == json.loads(capsys.readouterr().out)
    assert a["verify"]["fit"]["kv_cache_dtype"] == "fp8"
    assert a["launch"]["vllm@0.33.0"]["command"].strip() == launch.strip()
    assert "--kv-cache-dtype fp8" in launch
