#!/usr/bin/env python3
"""How fast one core hashes a file with sha256 where quantize hashes its last shard: on a thread of a
process whose main thread is busy in Python, against the same thread alone, a child process (no shared
GIL) beside the same busy thread, and `sha256sum`.

    python3 scripts/bench_sha256_threads.py [--dir /dev/shm] [--gb 3.9] [--read-mib 64] [--rounds 2]

quantize's manifest names each shard's sha256, which one core computes in file order; the last layer's
shard (3.9 GB for the 397B) is hashed while it is written, and the job ends when that hash does (issue 27:
4.0-5.1 s after the last layer on the H200, its hash thread at 0.76-0.88 GB/s inside the job against
1.15-1.40 GB/s for one core alone). Each read and each update gives up the GIL and then waits for it behind
the main thread; this shows how much of the gap that is: if a child process hashes no faster beside the
busy thread than a thread does, the GIL is not the cause. The file is written once (random bytes, so no
page is shared), read from the page cache (or tmpfs) by every run: what is timed is the hash, not a disk.

Two more rows time qtool's own writer (qtool.io.writer.HashedWrites) writing the same bytes into a new file
in --dir from 64 MiB buffers, beside the busy thread, to its digest: "trailing" lets the hash fall behind and
read the file back (every layer shard but the last), "keeping pace" makes the writer wait for the hash, which
then hashes the buffers themselves (the job's last shard).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# the same loop as the child's: read into one buffer, hash it (qtool.io.writer.HashedWrites' trailing hash)
CHILD = """
import hashlib, os, sys
size = int(sys.argv[2]) << 20
h, buf, fd, pos = hashlib.sha256(), memoryview(bytearray(size)), os.open(sys.argv[1], os.O_RDONLY), 0
while True:
    n = os.preadv(fd, [buf], pos)
    if not n:
        break
    h.update(buf[:n])
    pos += n
print(h.hexdigest())
"""


def hash_file(path: Path, read_mib: int) -> str:
    h, buf, fd, pos = hashlib.sha256(), memoryview(bytearray(read_mib << 20)), os.open(path, os.O_RDONLY), 0
    try:
        while True:
            n = os.preadv(fd, [buf], pos)
            if not n:
                return h.hexdigest()
            h.update(buf[:n])
            pos += n
    finally:
        os.close(fd)


def busy(stop: threading.Event) -> None:
    """A main thread's Python work (the layer loop's launches and bookkeeping): holds the GIL but for the
    interpreter's switch interval."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def pieces(size: int, blocks: list[bytes]):
    """`size` bytes: the blocks in turn, the last one cut short (the bench file's bytes, and the writer's)."""
    left, i = size, 0
    while left:
        k = min(left, len(blocks[i % len(blocks)]))
        yield memoryview(blocks[i % len(blocks)])[:k]
        left -= k
        i += 1


def write_hashed(path: Path, size: int, blocks: list[bytes], keep_pace: bool) -> str:
    """Write `size` bytes of the blocks in turn into a new file through HashedWrites; its digest."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from qtool.io.writer import HashedWrites

    out_path = path.with_suffix(".out")
    try:
        with open(out_path, "wb", buffering=16 << 20) as f:  # the layer writer's buffer (layer.WRITE_BUFFER)
            out = HashedWrites(f, path=out_path, keep_pace=keep_pace)  # as quantize's layer writer
            for piece in pieces(size, blocks):
                out.write(piece)
            return out.digest().result()
    finally:
        out_path.unlink(missing_ok=True)


def timed(mode: str, path: Path, read_mib: int, size: int = 0, blocks: list[bytes] = ()) -> tuple[float, str]:
    stop = threading.Event()
    worker = None
    if mode.endswith("busy"):
        worker = threading.Thread(target=busy, args=(stop,), daemon=True)
        worker.start()
    t = time.perf_counter()
    try:
        if mode.startswith("writer"):
            out: list[str] = []
            th = threading.Thread(target=lambda: out.append(write_hashed(path, size, blocks, "pace" in mode)))
            th.start()
            th.join()
            digest = out[0]
        elif mode.startswith("thread"):
            out: list[str] = []
            th = threading.Thread(target=lambda: out.append(hash_file(path, read_mib)))
            th.start()
            th.join()
            digest = out[0]
        elif mode.startswith("child"):
            digest = subprocess.run([sys.executable, "-S", "-c", CHILD, str(path), str(read_mib)], check=True,
                                    capture_output=True, text=True).stdout.strip()
        else:
            digest = subprocess.run(["sha256sum", str(path)], check=True, capture_output=True,
                                    text=True).stdout.split()[0]
        return time.perf_counter() - t, digest
    finally:
        stop.set()
        if worker is not None:
            worker.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--gb", type=float, default=3.9, help="file size (the 397B's layer shard: 3.9 GB)")
    ap.add_argument("--read-mib", type=int, default=64, help="bytes per read and update (qtool's: 64 MiB)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    path = a.dir / "qtool-sha256-bench.bin"
    size = int(a.gb * 1e9)
    # several distinct blocks, 256 MiB in all: more than a cache holds, as the fresh buffers quantize writes
    blocks = [os.urandom(64 << 20) for _ in range(4)]
    with open(path, "wb") as f:
        for piece in pieces(size, blocks):
            f.write(piece)
    try:
        modes = ["thread alone", "thread, main busy", "child, main busy", "sha256sum",
                 "writer trailing, busy", "writer keeping pace, busy"]
        results: dict[str, list[float]] = {m: [] for m in modes}
        digests = set()
        for _ in range(a.rounds):  # interleaved: a slower moment of the machine hits every row
            for m in modes:
                s, d = timed(m, path, a.read_mib, size, blocks)
                results[m].append(s)
                digests.add(d)
        if len(digests) != 1:
            raise SystemExit(f"the runs disagree on the digest: {sorted(digests)}")
        base = min(results["thread alone"])
        print(f"{size / 1e9:.1f} GB in {a.dir}, {a.read_mib} MiB reads, best of {a.rounds}:")
        for m in modes:
            s = min(results[m])
            print(f"  {m:<26} {s:6.2f} s  {size / s / 1e9:5.2f} GB/s  x{s / base:.2f} of the thread alone")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
