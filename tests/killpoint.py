"""Kill -9 a qtool command at a chosen moment, as a user's crash or `kill -9` would.

    python tests/killpoint.py MODULE:QUALNAME N -- qtool-args...

runs `qtool qtool-args...` in this process, with MODULE.QUALNAME wrapped so that the process sends itself
SIGKILL right after the Nth call of it returns (nothing after that point runs: no finally, no atexit).
No hook in qtool's own code: the tests choose the moment by naming the function.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def install(target: str, n: int) -> None:
    mod_name, qual = target.split(":")
    obj = importlib.import_module(mod_name)
    *owners, attr = qual.split(".")
    for o in owners:
        obj = getattr(obj, o)
    fn = getattr(obj, attr)
    calls = [0]

    def wrapped(*a, **k):
        r = fn(*a, **k)
        calls[0] += 1
        if calls[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return r

    setattr(obj, attr, wrapped)


def run_killed(target: str, n: int, args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run `qtool args` in a subprocess killed after the Nth return of `target`."""
    cmd = [sys.executable, str(Path(__file__)), target, str(n), "--", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def run_qtool(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, **kw)


if __name__ == "__main__":
    target, n, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: killpoint.py MODULE:QUALNAME N -- ARGS"
    install(target, int(n))
    from qtool.cli.main import main

    sys.exit(main(argv))
