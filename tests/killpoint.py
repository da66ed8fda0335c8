"""Kill -9 a qtool command at a chosen moment, as a user's crash or `kill -9` would.

    python tests/killpoint.py MODULE:QUALNAME N -- qtool-args...
    python tests/killpoint.py MODULE:QUALNAME N ENOSPC -- qtool-args...

runs `qtool qtool-args...` in this process, with MODULE.QUALNAME wrapped so that the process sends itself
SIGKILL right after the Nth call of it returns (nothing after that point runs: no finally, no atexit), or,
with an errno name, so that the Nth call raises that OSError instead (a full or read-only disk at that
moment), or with PAUSE:FILE, so that the process stops there (it creates FILE.paused and waits for FILE.go:
a second run can then be made to happen at exactly that moment). No hook in qtool's own code: the tests choose the
moment by naming the function.
KILLPOINT_SLOW=MODULE:QUALNAME:SECONDS (environment) also makes each call of that function take that much
longer (a slow disk or hash, where a race depends on it). A run that exits (not killed) says on stderr which
of qtool's threads were still alive at its exit ("qtool threads alive at exit: ..."): none may be.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def _owner(target: str):
    """MODULE:QUALNAME -> (the object holding it, its attribute name, the function)."""
    mod_name, qual = target.split(":")
    obj = importlib.import_module(mod_name)
    *owners, attr = qual.split(".")
    for o in owners:
        obj = getattr(obj, o)
    return obj, attr, getattr(obj, attr)


def install(target: str, n: int, fail: str | None = None) -> None:
    obj, attr, fn = _owner(target)
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        if fail is not None and not fail.startswith("PAUSE:") and calls[0] == n:
            import errno

            code = getattr(errno, fail)
            raise OSError(code, os.strerror(code), str(a[0]) if a and isinstance(a[0], (str, os.PathLike)) else None)
        r = fn(*a, **k)
        if fail is not None and fail.startswith("PAUSE:") and calls[0] == n:
            import time

            marker = fail.split(":", 1)[1]
            Path(marker + ".paused").touch()
            while not os.path.exists(marker + ".go"):
                time.sleep(0.05)
        elif fail is None and calls[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return r

    setattr(obj, attr, wrapped)


def slow_down(spec: str) -> None:
    """MODULE:QUALNAME:SECONDS: each call sleeps that long first."""
    import time

    target, seconds = spec.rsplit(":", 1)
    obj, attr, fn = _owner(target)

    def slowed(*a, **k):
        time.sleep(float(seconds))
        return fn(*a, **k)

    setattr(obj, attr, slowed)


def run_killed(target: str, n: int, args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run `qtool args` in a subprocess killed after the Nth return of `target`."""
    cmd = [sys.executable, str(Path(__file__)), target, str(n), "--", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def run_failing(target: str, n: int, errno_name: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run `qtool args` in a subprocess whose Nth call of `target` raises OSError(errno_name)."""
    cmd = [sys.executable, str(Path(__file__)), target, str(n), errno_name, "--", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def start_paused(target: str, n: int, marker: Path, args: list[str]) -> subprocess.Popen:
    """Start `qtool args`; it stops right after the Nth return of `target` (`marker`.paused appears) until
    `marker`.go exists."""
    cmd = [sys.executable, str(Path(__file__)), target, str(n), f"PAUSE:{marker}", "--", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_qtool(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, **kw)


if __name__ == "__main__":
    target, n, *rest = sys.argv[1:]
    fail = None if rest[0] == "--" else rest.pop(0)
    assert rest[0] == "--", "usage: killpoint.py MODULE:QUALNAME N [ERRNO] -- ARGS"
    argv = rest[1:]
    # a user's Ctrl-C comes from a terminal: Python's KeyboardInterrupt handler, even when the test run was
    # started in the background (`cmd &` in a script starts it with SIGINT ignored, and Python then keeps
    # SIG_IGN: the interrupt tests would see a run that ignores Ctrl-C)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install(target, int(n), fail)
    import atexit
    import faulthandler
    import threading

    faulthandler.enable()  # an abort (SIGABRT from a C++ terminate) prints every thread's Python stack

    def _lingering() -> None:
        # after the non-daemon threads are joined: a qtool daemon thread still running here is killed at
        # its next step, and one in torch's code then aborts the process (pytorch#38228)
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("qtool-") and t.is_alive())
        if alive:
            print(f"qtool threads alive at exit: {', '.join(alive)}", file=sys.stderr)

    atexit.register(_lingering)
    if os.environ.get("KILLPOINT_SLOW"):
        slow_down(os.environ["KILLPOINT_SLOW"])
    from qtool.cli.main import main

    sys.exit(main(argv))
