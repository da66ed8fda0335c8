"""The `qtool` process ends without the interpreter's teardown once its command is done
(qtool.process_exit): what a user sees of the command stays whole."""

import json
import os
import subprocess
import sys

# run as `qtool ...` is: console() after sys.argv is set; an object in __main__ reports the teardown
# (clearing __main__'s globals deletes it), an exit handler reports that the exit handlers ran
PROGRAM = """\
import atexit, sys
class Teardown:
    def __del__(self):
        sys.stderr.write("TORN DOWN\\n")
witness = Teardown()
atexit.register(lambda: sys.stderr.write("EXIT HANDLER RAN\\n"))
{before}
sys.argv = ["qtool", *{argv!r}]
from qtool.cli.main import console
console()
"""


def _run(argv, before="", stdout=subprocess.PIPE):
    code = PROGRAM.format(argv=argv, before=before)
    # stdout buffered as a user's is: a flush left out loses output here (this machine sets PYTHONUNBUFFERED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(
        [sys.executable, "-c", code], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=300
    )


def test_a_finished_command_skips_the_teardown_and_keeps_its_output_its_exit_handlers_and_its_code():
    p = _run(["recipes", "list", "--json"])
    assert p.returncode == 0, p.stderr
    assert "qwen35-nvfp4-experts" in json.loads(p.stdout)["quantize"]  # the whole report, through a pipe
    assert "EXIT HANDLER RAN" in p.stderr
    assert "TORN DOWN" not in p.stderr


def test_a_failed_command_keeps_its_error_and_its_exit_code(tmp_path):
    p = _run(["inspect", str(tmp_path / "missing"), "--json"])
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["message"] == "checkpoint not found"
    assert "TORN DOWN" not in p.stderr


def test_what_native_code_printed_is_flushed_too():
    p = _run(["recipes", "list"], before="import ctypes\nctypes.CDLL(None).printf(b'NATIVE LINE\\n')")
    assert p.returncode == 0, p.stderr
    assert "NATIVE LINE" in p.stdout and "qwen35-nvfp4-experts" in p.stdout
    assert "TORN DOWN" not in p.stderr


def test_a_report_that_cannot_be_written_is_no_success():
    """`qtool ... > out.json` on a full disk: the report is still in stdout's buffer when the command ends."""
    if not os.path.exists("/dev/full"):
        import pytest

        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        p = _run(["recipes", "list", "--json"], stdout=full)
    assert p.returncode == 120, p.stderr
    assert "could not write the output to stdout" in p.stderr and "No space left" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_thread_still_running_gets_the_normal_exit_which_waits_for_it():
    before = (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(1), sys.stderr.write('THREAD FINISHED\\n'))).start()"
    )
    p = _run(["recipes", "list"], before=before)
    assert p.returncode == 0, p.stderr
    assert "THREAD FINISHED" in p.stderr
    assert "TORN DOWN" in p.stderr


def test_a_profiled_run_still_writes_its_profile(tmp_path):
    prof = tmp_path / "run.prof"
    p = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "qtool", "recipes", "list"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    import pstats

    assert pstats.Stats(str(prof)).total_calls > 0
