"""Ending the qtool process once its command is done, without the interpreter's teardown.

The teardown frees every module and object one by one: 0.75 s after torch and transformers' decoder module
are imported on the 2-core VM (0.30 s with torch alone; 0.03 s ending with `os._exit` after the exit
handlers), all after the command's output is complete, fsynced and reported. The kernel frees the memory,
files and device contexts at the process's end either way.

What the teardown would do that matters is kept: the exit handlers run (`atexit`: logging's flush,
temporary directories' clean-up, a library's own handlers), and stdout and stderr are flushed, Python's
buffers and the C library's (native code's prints). A failed flush of stdout changes the exit code as
Python's own exit does: a full disk under `qtool ... > out.json` is not a success. The teardown is skipped
only when nothing else could still need the interpreter: no other non-daemon thread is alive (the normal
exit would wait for it) and no profiler, tracer or debugger is installed (`python -m cProfile -m qtool`
writes its results after the program returns).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

BROKEN_PIPE = 141  # the shell's code for a reader gone away (SIGPIPE), as the CLI's own (cli/main.py)
UNWRITTEN = 120  # Python's own exit code when its final flush of stdout fails


def flush_stdio(code: int) -> int:
    """Flush stdout and stderr (Python's buffers, then the C library's); the exit code the process should
    end with: `code`, or BROKEN_PIPE where the reader of stdout went away, or UNWRITTEN (said on stderr)
    where stdout could not be written (a full disk) and `code` was a success."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:
        code = code or BROKEN_PIPE
        drop_stdout()
    except (OSError, ValueError) as e:
        if code == 0:
            code = UNWRITTEN
        drop_stdout()
        _say(f"qtool: could not write the output to stdout ({e})")
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except (OSError, ValueError):
        pass  # nowhere left to say so
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what native code printed, which os._exit would drop
    except (OSError, AttributeError, TypeError):
        pass  # no C library to ask by that name (Windows: CDLL(None) is refused)
    return code


def drop_stdout() -> None:
    """Send what is left of stdout nowhere, so that no later flush fails again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _say(message: str) -> None:
    try:
        if sys.stderr is not None:
            print(message, file=sys.stderr)
    except (OSError, ValueError):
        pass


def end_now(code: int, *, exit_handlers: bool = True) -> NoReturn:
    """Exit with `code` at once: the exit handlers first (unless `exit_handlers` is False), then stdout and
    stderr flushed (which can change the code: flush_stdio), then `os._exit`."""
    if exit_handlers:
        atexit._run_exitfuncs()  # each handler's error is printed and the rest still run, as at a normal exit
    os._exit(flush_stdio(code))


def teardown_needed() -> bool:
    """Whether the interpreter's normal exit must run: another non-daemon thread is alive, or a profiler,
    tracer or debugger waits for the program to return."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile and debuggers register here
    if monitoring is not None and any(
        monitoring.get_tool(tool) is not None for tool in (monitoring.DEBUGGER_ID, monitoring.PROFILER_ID)
    ):
        return True
    me = threading.current_thread()
    return any(t is not me and t.is_alive() and not t.daemon for t in threading.enumerate())
