import os
import subprocess
import sys

import pytest

from qtool import __version__


def _run(*args):
    return subprocess.run([sys.executable, "-m", "qtool", *args], capture_output=True, text=True)


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from qtool.cli.main import main\n"
        "from qtool.cli.main import COMMANDS\n"
        "extra = [['assemble', 'hybrid', '--help'], ['eval', 'kld', '--help']]\n"
        "for argv in [['--help']] + [[c, '--help'] for c in COMMANDS] + extra:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_version():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"qtool {__version__}"


def test_user_error_is_not_a_traceback(tmp_path):
    r = _run("inspect", str(tmp_path / "missing"))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "checkpoint not found" in r.stderr


def test_no_command_is_usage():
    assert _run().returncode == 2


def test_output_cut_short_by_the_reader_is_not_a_traceback(tiny_nvfp4_modelopt):
    """`qtool inspect CKPT | head -1`: the reader goes away before qtool has written (the whole report of
    the tiny model would fit in the pipe's buffer, so the pipe is closed before qtool even starts)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "qtool", "inspect", str(tiny_nvfp4_modelopt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err, err


def test_a_mistyped_command_gets_a_did_you_mean():
    r = _run("inspcet", "x")
    assert r.returncode == 2 and "did you mean inspect?" in r.stderr


def test_usage_errors_under_json_are_json():
    """Found as: with --json, a usage error printed argparse's text (a script parsing stdout got nothing)."""
    import json

    for args in (["inspcet", "x", "--json"], ["inspect", "--json"], ["verify", "x", "--tp", "two", "--json"]):
        r = _run(*args)
        assert r.returncode == 2, args
        err = json.loads(r.stdout)
        assert err["error"] == "UsageError" and err["message"] and err["hint"], args


@pytest.mark.slow
def test_progress_bars_only_on_a_terminal(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `layers: 0layer [00:00, ?layer/s]` in logs: bars were drawn into a pipe."""
    r = _run(
        "calibrate-kv",
        str(tiny_nvfp4_modelopt),
        "-o",
        str(tmp_path / "kv"),
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--replace-scales",
    )
    assert r.returncode == 0, r.stderr
    assert "layer/s" not in r.stderr and "it/s" not in r.stderr, r.stderr


def test_a_job_gets_growing_gpu_segments_unless_the_user_configured_the_allocator(monkeypatch, capsys):
    """Every qtool command sets torch's CUDA allocator to expandable segments (less memory held for the same
    tensors in a layer-streamed job) before it runs; a user's own setting, under either of the names torch
    reads, is kept."""
    from qtool.cli.main import main

    for user in (
        {},
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
        {"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
    ):
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)
        for name, value in user.items():
            monkeypatch.setenv(name, value)
        assert main(["recipes", "list"]) == 0
        got = {n: os.environ.get(n) for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        want = {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None, **user}
        if not user:
            want["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        assert got == want
    capsys.readouterr()
