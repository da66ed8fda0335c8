"""Run a qtool command in the test's own process, with what a subprocess would give back.

    from in_process import run_cli
    r = run_cli(["quantize", src, "-o", out], env={**os.environ, "QTOOL_CACHE_DIR": cache})
    assert r.returncode == 1 and "fix:" in r.stderr

`run_cli` takes the arguments `killpoint.run_qtool` takes (a list of arguments, `env`, `cwd`) and returns the
same `subprocess.CompletedProcess` (returncode, stdout, stderr as text), but calls `qtool.cli.main.main`
here: no interpreter start and no import of torch per call (1-3 s each on a 2-core machine). Use it where
the test checks what the command prints, writes and exits with. Keep a real process (`run_qtool`,
`killpoint.run_killed`, `start_paused`, ranks) where the test kills, pauses or signals the command, checks
the interpreter's start or exit (imports at start, threads alive at exit, the final flush of stdout), or runs
several ranks.

What a process would show and this one must too: an exception that escapes `main` is a traceback on stderr
and exit code 1 (as the interpreter prints it), and argparse's exit is its exit code.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from qtool import redact
from qtool.cli.main import main


def run_cli(
    args: list, *, env: dict | None = None, cwd: str | Path | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`qtool args` in this process: its exit code and what it wrote to stdout and stderr. (`timeout` is
    accepted for run_qtool's callers and not enforced: a hang here is the test run's own timeout.)"""
    argv = [str(a) for a in args]
    out, err = _text_stream(), _text_stream()
    with _environment(env), _working_directory(cwd), _std_streams(out, err), _fresh_redaction():
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # noqa: BLE001 (what the interpreter would print for an uncaught exception)
            traceback.print_exc(file=sys.stderr)
            code = 1
    return subprocess.CompletedProcess(["qtool", *argv], code, _text(out), _text(err))


def _text_stream() -> io.TextIOWrapper:
    """A text stream over bytes (some writers use `.buffer`), as a pipe's stdout would be."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", errors="backslashreplace")


@contextlib.contextmanager
def _std_streams(out: io.TextIOWrapper, err: io.TextIOWrapper) -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


@contextlib.contextmanager
def _environment(env: dict | None) -> Iterator[None]:
    """os.environ replaced by `env` for the call (as a child started with env=... would see it), then put back
    whole: what the command set itself (TRANSFORMERS_VERBOSITY, ...) does not leak into the next test."""
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _working_directory(cwd: str | Path | None) -> Iterator[None]:
    saved = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def _fresh_redaction() -> Iterator[None]:
    """The token values a command learns from its argv (qtool.redact) are its own, as in a process: a token
    an earlier test passed must not be masked in a later test's output."""
    saved = set(redact._secrets), redact._real_flags
    redact._secrets.clear()
    try:
        yield
    finally:
        redact._secrets.clear()
        redact._secrets.update(saved[0])
        redact._real_flags = saved[1]
