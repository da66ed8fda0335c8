#!/usr/bin/env python3
"""Where a qtool command's wall clock goes, thread by thread: a sampling profiler with no overhead worth
the name (cProfile slows imports and small calls 2-5x, so its "before the first layer" is not the user's).

Runs `python -m qtool ARGS` in this process, and every `--every` seconds records each thread's innermost
frame in qtool (else the innermost frame of any module, e.g. an import), then prints each thread's
segments of consecutive samples in the same place, longest first, and the main thread's timeline.

    python3 benchmarks/timeline.py [--every 0.05] [--top 40] -- quantize SRC -o OUT --recipe ... --device cuda

`--stop-at qtool.stream.layer_stream:LayerStreamer.load_layer` ends the command (os._exit, no clean-up: use
a scratch output) when that function is first called, and prints the timeline up to there: a job's start
at the 397B's real tensor count on a sparse checkpoint (benchmarks/make_sparse_397b.py), whose layers no box
here could run.
"""

from __future__ import annotations

import argparse
import atexit
import runpy
import sys
import threading
import time
from collections import defaultdict

T0 = time.perf_counter()


def _place(frame) -> str:
    """The innermost qtool frame of a stack (file:function), else the innermost frame, with the
    module being imported if the stack is inside an import."""
    inner, importing, ours = None, None, []
    f = frame
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if inner is None:
            inner = f"{name.rsplit('/', 2)[-1]}:{code.co_name}"
        if len(ours) < 2 and "/qtool/" in name and "/benchmarks/" not in name:
            ours.append(f"{name.split('/qtool/', 1)[1]}:{code.co_name}")
        if importing is None and code.co_name == "_find_and_load":
            importing = f.f_locals.get("name")
        f = f.f_back
    where = " < ".join(ours) if ours else (inner or "?")  # the innermost qtool frame, then its caller
    return f"{where} [import {importing}]" if importing else where


def sample(every: float, out: dict, stop: threading.Event) -> None:
    me = threading.get_ident()
    # each thread (the object: a new thread may get the id of one that ended) -> a unique name, since each
    # shard's hash thread has the same name as the others
    keys: dict[threading.Thread, str] = {}
    counts: dict[str, int] = defaultdict(int)
    while not stop.is_set():
        now = time.perf_counter() - T0
        threads = {t.ident: t for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            t = threads.get(ident)
            if ident == me or t is None:
                continue
            key = keys.get(t)
            if key is None:
                counts[t.name] += 1
                key = keys[t] = t.name if counts[t.name] == 1 else f"{t.name}#{counts[t.name]}"
            out[key].append((now, _place(frame)))
        time.sleep(every)


def segments(samples: list[tuple[float, str]], every: float) -> list[tuple[float, float, str]]:
    segs = []
    for t, place in samples:
        if segs and segs[-1][2] == place and t - segs[-1][1] <= 2.5 * every:
            segs[-1] = (segs[-1][0], t, place)
        else:
            segs.append((t, t, place))
    return [(a, b + every, p) for a, b, p in segs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.05)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument(
        "--all-in-order", action="store_true", help="every thread's segments in order (not only the main thread's)"
    )
    ap.add_argument(
        "--stop-at",
        metavar="MODULE:QUALNAME",
        help="end the command when this function is first called (e.g. "
        "qtool.stream.layer_stream:LayerStreamer.load_layer) and print the timeline up to there",
    )
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    samples: dict = defaultdict(list)
    stop = threading.Event()
    th = threading.Thread(target=sample, args=(a.every, samples, stop), daemon=True)
    th.start()

    def report() -> None:
        if stop.is_set():
            return  # printed once: from the exit handler or after the command returns
        stop.set()
        th.join()
        end = time.perf_counter() - T0
        print(f"\n--- timeline: {end:.2f} s in all (sampled every {a.every} s)", file=sys.stderr)
        for name, ss in samples.items():
            segs = segments(ss, a.every)
            total = defaultdict(float)
            for s0, s1, p in segs:
                total[p] += s1 - s0
            print(f"\n[{name}] most time:", file=sys.stderr)
            for p, s in sorted(total.items(), key=lambda kv: -kv[1])[: a.top]:
                print(f"  {s:7.2f} s  {p}", file=sys.stderr)
            if name == "MainThread" or a.all_in_order:
                print(f"[{name}] in order (segments >= 0.1 s):", file=sys.stderr)
                for s0, s1, p in segs:
                    if s1 - s0 >= 0.1:
                        print(f"  {s0:7.2f} - {s1:7.2f}  {p}", file=sys.stderr)

    if a.stop_at:
        _stop_at(a.stop_at, report)
    # qtool's own exit (qtool.process_exit) runs the exit handlers and then ends the process at once
    atexit.register(report)
    sys.argv = ["qtool", *args]
    code = 0
    try:
        runpy.run_module("qtool", run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        report()
    return code


def _stop_at(target: str, report) -> None:
    """Make the first call of `target` print the timeline and end the process at once."""
    import importlib
    import os

    modname, _, qual = target.partition(":")
    owner = importlib.import_module(modname)
    *path, attr = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    getattr(owner, attr)  # a mistyped target fails here, before the command runs (not never stopping)

    def stopped(*args, **kwargs):
        print(f"\n--- stopped at the first call of {target}: {time.perf_counter() - T0:.2f} s", file=sys.stderr)
        report()
        sys.stdout.flush()  # os._exit skips the interpreter's own flushing
        sys.stderr.flush()
        os._exit(0)

    setattr(owner, attr, stopped)


if __name__ == "__main__":
    sys.exit(main())
