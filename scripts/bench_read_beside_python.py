#!/usr/bin/env python3
"""How fast the layer reader's reads go while the main thread runs Python (a plan), against the same reads
alone, in one run on one file.

quantize reads its first layer while it makes its output plan (session 30). The reader's threads read in
`preadv` calls in a Python loop (qtool.stream.layer_read), so each call's return needs the interpreter
back; while the main thread runs pure Python, a thread that wants it waits up to the switch interval
(`sys.getswitchinterval()`, 5 ms) for each. This bench reads FILE with READERS threads: through the page
cache (the file cached first) in calls of READ_PIECE (qtool's where a filesystem refuses direct reads:
1 MiB), 16 MiB and 64 MiB; then as qtool's reader reads it, cached (copied from the page cache, a CHUNK
a call) and evicted before each read (around the page cache where the filesystem allows it: from the
disk on a disk; tmpfs keeps its pages), alone and beside a busy Python loop, and prints the read rate of
each and how fast the Python loop ran beside the reads against alone (qtool.stream.layer_read says why
it reads as it does).

    python3 scripts/bench_read_beside_python.py FILE [--readers 4] [--switch-interval 0.0005]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # qtool from this checkout
from qtool.fixtures.page_cache import evict
from qtool.stream.layer_read import CHUNK, READ_PIECE, READERS, ShardFiles, aligned_empty, read_pieces

QTOOL_CACHED, QTOOL_EVICTED = 0, -1  # `piece`: as qtool's layer reader reads, the file cached / evicted


def read_all(path: str, size: int, piece: int, readers: int) -> float:
    """Seconds to read the file with `readers` threads, each its share of CHUNK pieces, `piece` a call
    through the page cache, or (QTOOL_*) as qtool's layer reader reads."""
    chunks = read_pieces(path, 0, size)
    if piece == QTOOL_EVICTED:
        evict([path])

    def work(k: int) -> None:
        fd, buf, reader = os.open(path, os.O_RDONLY), memoryview(aligned_empty(CHUNK).numpy()), ShardFiles()
        try:
            for p in chunks[k::readers]:
                if piece <= 0:
                    reader.read(p, buf[:p.end - p.start])
                    continue
                want, got = p.hi - p.lo, 0
                while got < want:
                    got += os.preadv(fd, [buf[got:min(want, got + piece)]], p.lo + got)
        finally:
            os.close(fd)
            reader.close()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def python_loop(stop: threading.Event) -> int:
    """Pure Python, like a plan's per-tensor work: rounds done until `stop`."""
    rounds, table = 0, {}
    while not stop.is_set():
        for i in range(1000):
            table[i] = str(i)
        rounds += 1
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--readers", type=int, default=READERS)
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for the run (default 5 ms)")
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    size = os.path.getsize(a.file)
    read_all(a.file, size, 16 << 20, a.readers)  # into the page cache
    print(f"{a.file}: {size / 1e9:.2f} GB cached, {a.readers} readers, switch interval "
          f"{sys.getswitchinterval() * 1e3:.2f} ms")
    for piece in [*sorted({READ_PIECE, 16 << 20, 64 << 20}), QTOOL_CACHED, QTOOL_EVICTED]:
        alone = read_all(a.file, size, piece, a.readers)
        stop, took = threading.Event(), {}

        def reads() -> None:
            took["s"] = read_all(a.file, size, piece, a.readers)
            stop.set()

        r = threading.Thread(target=reads)
        r.start()
        beside = python_loop(stop)
        r.join()
        stop2 = threading.Event()
        threading.Timer(took["s"], stop2.set).start()
        solo = python_loop(stop2)
        how = (f"{piece >> 20:2d} MiB a call" if piece > 0 else
               f"qtool's reads, {'cached' if piece == QTOOL_CACHED else 'evicted'}, {CHUNK >> 20} MiB a call")
        print(f"  {how}: reads {size / alone / 1e9:.2f} GB/s alone, "
              f"{size / took['s'] / 1e9:.2f} GB/s beside Python; the Python loop ran at "
              f"{beside / max(solo, 1):.2f}x its speed alone", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
