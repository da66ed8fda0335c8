import subprocess
import sys

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
    p = subprocess.Popen([sys.executable, "-m", "qtool", "inspect", str(tiny_nvfp4_modelopt)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err, err
