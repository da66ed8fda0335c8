"""A new user's first hour (issue 53): each defect found by trying qtool as a new user, reproduced with the
same command and input it was found with."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed_qtool(args, *, cwd, timeout=300):
    """`qtool ARGS` as the installed console script runs it: the script's own folder first on sys.path (never
    the current folder), and the package found by the install, not through PYTHONPATH (which would also reach
    the ranks' `sys.path` and hide the shadowing)."""
    boot = (
        f"import sys\nsys.path[0] = {str(ROOT)!r}\n"
        "from qtool.cli.main import console\nsys.argv = ['qtool', *sys.argv[1:]]\nconsole()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", boot, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_ranks_start_in_a_folder_that_holds_a_qtool_folder(tiny_bf16, tmp_path):
    """Found: `cd DIR && qtool quantize ... --nproc 2` where DIR holds a folder named `qtool` (the parent of a
    clone): every rank died with `ImportError: cannot import name '__version__' from 'qtool'` (the ranks ran
    `python -m qtool`, and the current folder shadowed the package), then the launcher offered --resume."""
    (tmp_path / "qtool").mkdir()
    r = _installed_qtool(
        [
            "quantize",
            tiny_bf16,
            "-o",
            "q",
            "--recipe",
            "qwen35-nvfp4-experts",
            "--backend",
            "rtn",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--quiet",
            "--nproc",
            "2",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert (tmp_path / "q" / "qtool-manifest.json").exists()


def _printed_so_far(stream) -> str:
    """What a paused process has written into its pipe so far (no wait for its end)."""
    os.set_blocking(stream.fileno(), False)
    data = os.read(stream.fileno(), 1 << 20) if stream else b""
    return data.decode()


def test_a_job_without_a_terminal_prints_its_plan_and_layers_as_it_goes(tiny_bf16, tmp_path):
    """Found: `qtool quantize ... > log` printed no line until its end (0 lines at 5 and 15 s of a 20.7 s
    job); on a terminal the plan ("fits this machine") came only after the work. Here the job is paused at
    its second layer's journal entry (the first is done), with stdout and stderr pipes: the plan and the first layer are
    out."""
    from killpoint import start_paused

    marker = tmp_path / "m"
    p = start_paused(
        "qtool.stream.layer_journal:write_json",
        3,
        marker,
        [
            "quantize",
            tiny_bf16,
            "-o",
            tmp_path / "q",
            "--recipe",
            "qwen35-nvfp4-experts",
            "--backend",
            "rtn",
            "--samples",
            "2",
            "--seq-len",
            "16",
        ],
    )
    try:
        deadline = 120
        while not Path(str(marker) + ".paused").exists():
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
            deadline -= 0.05
            assert deadline > 0
        out, err = _printed_so_far(p.stdout), _printed_so_far(p.stderr)
    finally:
        Path(str(marker) + ".go").touch()
    _, rest_err = p.communicate(timeout=300)
    assert p.returncode == 0, err + rest_err
    assert "peak memory" in out and "recipe" in out, (out, err)
    assert "wrote" not in out
    assert "layers: 1/" in err, err
    assert "layers: 8/8 done" in err + rest_err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_layer_bar_on_a_terminal_has_a_total(tiny_bf16, tmp_path, monkeypatch):
    """Found: quantize, calibrate-kv and sensitivity drew `layers: 7layer [00:08, 1.38layer/s]` on a
    terminal: no total, no percentage, no ETA (eval kld's bars have them)."""
    from qtool.cli.main import main

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert (
        main(
            [
                "quantize",
                str(tiny_bf16),
                "-o",
                str(tmp_path / "q"),
                "--recipe",
                "qwen35-nvfp4-experts",
                "--backend",
                "rtn",
                "--samples",
                "2",
                "--seq-len",
                "16",
            ]
        )
        == 0
    )
    assert "100%" in term.getvalue() and "8/8" in term.getvalue(), term.getvalue()


def test_a_reference_of_other_windows_gives_a_fix_that_runs(tiny_bf16, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys):
    """Found: `eval kld --ref REF.compact --test T --windows 8 --seq-len 64` with a reference saved with
    other windows said `... --stride None` in its fix, which the parser rejects (rc 2)."""
    import shlex

    from qtool.cli.main import main

    ref = tmp_path / "ref.compact"
    assert (
        main(
            [
                "eval",
                "kld",
                "--ref",
                str(tiny_bf16),
                "--save-ref",
                str(ref),
                "--windows",
                "2",
                "--seq-len",
                "32",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    test = ["eval", "kld", "--ref", str(ref), "--test", str(tiny_nvfp4_modelopt_nomtp), "--quiet"]
    assert main([*test, "--windows", "8", "--seq-len", "64"]) == 1
    err = capsys.readouterr().err
    fix = err.split("use the windows it was saved with:", 1)[1].splitlines()[0]
    assert "None" not in fix, err
    assert main([*test, *shlex.split(fix)]) == 0, capsys.readouterr().err


def test_serve_config_with_auto_kv_does_not_say_a_calibrated_checkpoint_lacks_scales(tiny_nvfp4_modelopt, capsys):
    """Found: `serve-config demo-out --engine vllm --tp 1 --kv-cache-dtype auto` said "no calibrated FP8 k/v
    scales (qtool calibrate-kv adds them)" for a checkpoint that has them."""
    from qtool.cli.main import main

    assert (
        main(["serve-config", str(tiny_nvfp4_modelopt), "--engine", "vllm", "--tp", "1", "--kv-cache-dtype", "auto"])
        == 0
    )
    said = capsys.readouterr()
    assert "no calibrated FP8" not in said.out + said.err
    assert "calibrated FP8 k/v scales are not used" in said.out + said.err


def _reflinks_possible(folder: Path) -> bool:
    from qtool.errors import WriteError
    from qtool.io.files import LinkMode, Placer

    (folder / "probe").write_bytes(b"x" * 4096)
    try:
        return Placer(LinkMode.REFLINK).place(folder / "probe", folder / "probe2") == "reflink"
    except WriteError:  # no reflinks here
        return False
    finally:
        for name in ("probe", "probe2"):
            (folder / name).unlink(missing_ok=True)


def test_build_says_when_its_published_shards_are_copies(tiny_bf16, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys):
    """Found: docs/build.md said the published shards are reflinks or hard links; on ext4 they are full copies
    (link count 1), so a 397B build needs ~234 GiB more disk than the doc implied. The published artifact
    never shares an inode with the step cache (an edit through it would reach the cache and, through the
    cache's own links, the sources); the build says what the copies cost, and the doc says it."""
    from qtool.cli.main import main

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
    said = capsys.readouterr().out
    shards = sorted(out.glob("*.safetensors"))
    assert shards and all(s.stat().st_nlink == 1 for s in shards)
    if _reflinks_possible(tmp_path):
        assert "shards copied" not in said
    else:
        assert "shards copied" in said and "this filesystem has no reflinks" in said, said
    doc = " ".join((ROOT / "docs" / "build.md").read_text().split())
    assert "hard links (an edit" not in doc and "a full copy" in doc


def test_a_gpu_smaller_than_the_reserve_is_blamed_on_the_reserve(tiny_nvfp4_modelopt, capsys):
    """Found: `verify demo-out --tp 1 --gpus 1x1GB --max-model-len 1000000` blamed "the weights alone (0.0 GiB
    per GPU)"; the 4 GiB reserve is what does not fit, and the fit line (budget 0.8 = weights 0.0 + reserve 4.0
    + KV 0.0) did not add up."""
    from qtool.cli.main import main

    assert main(["verify", str(tiny_nvfp4_modelopt), "--tp", "1", "--gpus", "1x1GB", "--max-model-len", "1000000"]) == 3
    out = capsys.readouterr().out
    fix = next(ln for ln in out.splitlines() if ln.strip().startswith("fix:"))
    assert "weights alone" not in fix and "reserve (4.0 GiB" in fix and "GPUs of more than 4.4 GiB" in fix, out
    fit = next(ln for ln in out.splitlines() if ln.startswith("fit ("))
    assert "budget 0.8 GiB (0.9 GB) < weights 0.0 GiB + reserve 4.0 GiB = 4.0 GiB" in fit, fit


@pytest.mark.slow
@pytest.mark.xdist_group("measure")  # measures reads or memory: not beside another such test
def test_the_planned_host_memory_counts_the_process_itself(tiny_bf16, tmp_path):
    """Found: quantize's plan said "peak memory host ~36.7 MiB" for a run whose peak was 581-819 MB: the
    interpreter with torch and transformers was not counted. The plan is at least the process's own peak."""
    import re

    # the run's peak resident memory, measured by a parent of its own (RUSAGE_CHILDREN of this process would
    # be the largest of every child the test session ran)
    measure = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
        "print(r.stdout + r.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            measure,
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(tiny_bf16),
            "-o",
            "q",
            "--recipe",
            "qwen35-nvfp4-experts",
            "--backend",
            "rtn",
            "--samples",
            "2",
            "--seq-len",
            "16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    rc, peak = map(int, r.stdout.splitlines()[0].split())
    assert rc == 0, r.stdout
    size, unit = re.search(r"peak memory\s+host ~([\d.]+) (\w+)", r.stdout).groups()
    planned = float(size) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert planned >= 0.8 * peak, (r.stdout, peak)


def test_each_refusal_a_newcomer_met_has_a_fix_line(tiny_bf16, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys):
    """Found: these refusals had no `fix:` line (the README promises one): quantize --format awq with an NVFP4
    recipe, convert of a ModelOpt checkpoint --to modelopt, convert of an AWQ checkpoint, assemble
    --bf16-expert-layers 0,9 (a layer the model does not have)."""
    from qtool.cli.main import main

    awq = tmp_path / "awq"
    assert (
        main(
            [
                "quantize",
                str(tiny_bf16),
                "-o",
                str(awq),
                "--recipe",
                "qwen35-awq-int4",
                "--backend",
                "rtn",
                "--samples",
                "2",
                "--seq-len",
                "16",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    cases = [
        ["quantize", str(tiny_bf16), "-o", str(tmp_path / "q"), "--recipe", "qwen35-nvfp4-experts", "--format", "awq"],
        ["convert", str(tiny_nvfp4_modelopt_nomtp), "-o", str(tmp_path / "c"), "--to", "modelopt"],
        ["convert", str(awq), "-o", str(tmp_path / "c"), "--to", "compressed-tensors"],
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
            "0,9",
        ],
    ]
    for argv in cases:
        assert main(argv) in (1, 2), argv
        err = capsys.readouterr().err
        assert "\n    fix:" in err or "\nfix:" in err or "  fix:" in err, (argv, err)
        assert "Traceback" not in err


def test_a_hub_name_without_hf_is_answered_with_the_hf_source(tmp_path):
    """Found: `qtool inspect nvidia/Qwen3.5-397B-A17B-NVFP4` said "checkpoint not found; fix: check the path",
    with no "did you mean hf:nvidia/..."."""
    for cmd in (["inspect"], ["verify", "--tp", "1"]):
        r = _installed_qtool([*cmd, "nvidia/Qwen3.5-397B-A17B-NVFP4"], cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert "did you mean hf:nvidia/Qwen3.5-397B-A17B-NVFP4?" in r.stderr, r.stderr
    r = _installed_qtool(["inspect", "./missing"], cwd=tmp_path)
    assert r.returncode == 1 and "hf:" not in r.stderr and "check the path" in r.stderr, r.stderr


def test_the_set_up_leaves_the_clone_clean():
    """Found: the README's set-up (`qtool build demo-tiny -o demo-out` in the clone) left `demo-out.build/`
    untracked."""
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "/demo-out/" in ignored and "/demo-out.build/" in ignored


@pytest.mark.slow
def test_the_modelopt_backend_does_not_warn_of_the_pinned_transformers(tiny_bf16, tmp_path):
    """Found: the modelopt backend printed "transformers 5.17.0 is not tested with current version of
    modelopt" for the versions qtool pins (and tests together)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("modelopt") is None:
        pytest.skip("needs qtool[quant]")
    r = _installed_qtool(
        [
            "quantize",
            tiny_bf16,
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
            "--quiet",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "is not tested with current version of modelopt" not in r.stderr, r.stderr


def test_verify_deep_counts_shards_and_other_files_apart(tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path, capsys):
    """Found: `verify --deep` said "17 shard(s)" for 8 shards and 9 other files (the manifest's)."""
    from qtool.cli.main import main

    out = tmp_path / "h"
    assert (
        main(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                str(tiny_nvfp4_modelopt_nomtp),
                "--bf16",
                str(tiny_bf16),
                "-o",
                str(out),
                "--bf16-expert-layers",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["verify", str(out), "--tp", "1", "--deep"]) == 0
    deep = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("deep:"))
    shards = len(list(out.glob("*.safetensors")))
    others = sum(
        1 for p in out.iterdir() if p.is_file() and p.suffix != ".safetensors" and p.name != "qtool-manifest.json"
    )
    assert deep.startswith(f"deep: {shards} shard(s) and {others} other file(s),"), deep


def test_a_folder_of_checkpoints_is_the_same_error_in_verify_and_inspect(tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found: a folder of checkpoints was exit 3 (a failed verification) in verify and 1 in inspect."""
    import shutil

    shutil.copytree(tiny_nvfp4_modelopt_nomtp, tmp_path / "models" / "nvfp4")
    for cmd in (["inspect"], ["verify", "--tp", "1"]):
        r = _installed_qtool([*cmd, tmp_path / "models"], cwd=tmp_path)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "in this folder: nvfp4" in r.stderr, r.stderr


def test_calibrate_kv_on_a_machine_without_cuda_says_so_before_any_work(tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found: calibrate-kv --device cuda without a CUDA device printed its plan and began; the missing device
    came seconds later. It is said at once, before the plan, and nothing is left behind."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = _installed_qtool(
        [
            "calibrate-kv",
            tiny_nvfp4_modelopt_nomtp,
            "-o",
            "kv",
            "--replace-scales",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--device",
            "cuda",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "no CUDA device is available" in r.stderr, r.stderr
    assert r.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_mtp_note_is_said_once(tiny_nvfp4_modelopt, tmp_path):
    """Found: "the MTP head's attention layer is not calibrated" was printed twice (a plan note and a
    warning at the end)."""
    r = _installed_qtool(
        ["calibrate-kv", tiny_nvfp4_modelopt, "-o", "kv", "--replace-scales", "--samples", "2", "--seq-len", "16"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).count("the MTP head's attention layer is not calibrated") == 1


def test_more_than_three_speculative_tokens_is_a_warning(tiny_nvfp4_modelopt, capsys):
    """Found: the docs say MTP above 3 is unstable, while `verify --mtp 5` and `serve-config --mtp 5` passed
    without a word."""
    from qtool.cli.main import main

    assert main(["verify", str(tiny_nvfp4_modelopt), "--tp", "1", "--mtp", "5"]) == 0  # a warning, not an error
    assert "mtp-unstable" in capsys.readouterr().out
    assert main(["serve-config", str(tiny_nvfp4_modelopt), "--engine", "vllm", "--tp", "1", "--mtp", "5"]) == 0
    said = capsys.readouterr()
    assert "--mtp 3 at most" in said.out + said.err
    assert main(["verify", str(tiny_nvfp4_modelopt), "--tp", "1", "--mtp", "3"]) == 0
    assert "mtp-unstable" not in capsys.readouterr().out


def test_the_help_says_the_kv_default_and_every_dataset_form(capsys):
    """Found: `--help` of serve-config and report said the KV-cache default is BF16 (it is FP8 where the
    scales are calibrated); eval kld's `--dataset` help left out hf: datasets."""
    import pytest

    from qtool.cli.main import main

    for cmd in (["serve-config"], ["report"], ["verify"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (
            "default: fp8 where every full- attention layer has calibrated" in text
            or "default: fp8 where every full-attention layer has calibrated" in text
        ), (cmd, text)
    for cmd in (["eval", "kld"], ["quantize"], ["calibrate-kv"], ["sensitivity"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert "hf:ORG/NAME" in capsys.readouterr().out, cmd


def test_eval_kld_without_a_terminal_shows_it_moving(tiny_bf16, tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found: `qtool eval kld ... > log` printed 0 lines for 24 s of a 26.8 s run. Paused in the reference's
    second layer, with stdout and stderr pipes: its first layer is on record."""
    from killpoint import start_paused

    marker = tmp_path / "m"
    p = start_paused(
        "qtool.stream.layer_stream:LayerStreamer.forward_layer",
        2,
        marker,
        ["eval", "kld", "--ref", tiny_bf16, "--test", tiny_nvfp4_modelopt_nomtp, "--windows", "2", "--seq-len", "32"],
    )
    try:
        deadline = time.time() + 120
        while not Path(str(marker) + ".paused").exists():
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline
            time.sleep(0.05)
        err = _printed_so_far(p.stderr)
    finally:
        Path(str(marker) + ".go").touch()
    _, rest = p.communicate(timeout=300)
    assert p.returncode == 0, err + rest
    assert "layers bf16: 1/8 done" in err, err
