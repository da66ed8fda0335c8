"""sha256 of input files from the bytes a job reads anyway: one read of the input, not two.

A layer-streamed job (quantize, calibrate-kv) reads nearly all of its input once, layer by layer, in file
order. Hashing each input again in a thread of its own doubles what the disk must deliver once the input
no longer fits the page cache (an 800 GB 397B does not). Instead the readers hand what they read to the
file's `FileDigest`, whose own thread hashes it in file order, off the readers' path (sha256 runs at
~1.2 GB/s on the H200 machine's cores, slower than its disk reads; a reader that waited for it would slow
the layer loop to that pace):

- a reader claims its pieces before it starts (`claim`), and offers each once read (`offer`): a reference
  (CPU: the layer's buffer stays alive until hashed) or a copy (CUDA: the pinned staging buffer is reused),
  at most QUEUE_BYTES queued; past that a piece is dropped (its claim released) and read again by the
  digest, from the page cache while it is still there;
- the digest's thread hashes what lies at its cursor; bytes before a claimed piece that nobody claimed (a
  tensor the job does not need, a header, a dropped piece) it reads itself, once; it never reads ahead of
  the claims (those bytes are the job's next reads);
- `finish` reads the tail the job did not need and returns the hex digest.

Resume: a layer is journaled only once its bytes are hashed (`wait_covered`), and the prefix digest at
that point is recorded (`on_snapshot`); a resumed run, hashing again from the start, checks its own prefix
digest at that offset, so an input edited between the runs is refused even though the interrupted run
never finished a full digest.

The readers are handed the job's digests as an object (`DigestSink`): `StreamDigests`, made by the input
hasher that opens the inputs (qtool.io.manifest.InputHasher.read_digests), or `NO_DIGESTS` where nothing is
hashed from reads; a file the job did not register is not offered. The sink carries the job's input files
too (`inputs`: qtool.io.input_files), so that the readers read through the descriptors the job opened.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from qtool.io.input_files import InputFiles, open_for_reads

CHUNK = 8 << 20  # the digest's own reads
QUEUE_BYTES = 1 << 30  # offered bytes waiting to be hashed, per file, before pieces are dropped


class FileDigest:
    def __init__(self, path: str, check: tuple[int, str] | None = None, inputs: InputFiles | None = None) -> None:
        self.path = path
        self.inputs = inputs  # the job's input files: the digest reads the one descriptor opened
        self.h = hashlib.sha256()
        self.cursor = 0  # the bytes hashed (changed with `h` under `hlock`)
        self.hlock = threading.Lock()
        self.claims: dict[int, int] = {}  # start -> end of bytes a reader is reading
        self.queue: list = []  # heap of (start, seq, view): offered bytes
        self.queued = 0
        self._seq = 0
        self.cond = threading.Condition()
        self.finishing = False
        self.abandoned = False  # the job failed: the thread stops at its next step
        self.want = 0  # wait_covered's target: the digest reads what is missing up to it
        self.error: BaseException | None = None
        self.dropped = 0  # offered bytes the queue had no room for (read again by the digest)
        # (offset, prefix sha256) the interrupted run recorded; `mismatch` is set when ours differs there
        self.check = check
        self.mismatch = False
        self._fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="qtool-stream-sha256", daemon=True)
        self._thread.start()

    # -- readers ------------------------------------------------------------------------------------
    def claim(self, start: int, end: int) -> None:
        with self.cond:
            if end > start:
                self.claims[start] = max(end, self.claims.get(start, end))
                self.cond.notify_all()

    def release(self, start: int) -> None:
        """A claimed piece that will not be offered (its reader failed): the digest reads it itself."""
        with self.cond:
            self.claims.pop(start, None)
            self.cond.notify_all()

    def offer(self, start: int, view: memoryview, keep: Callable[[], bytearray] | None = None) -> None:
        """`view`: the file's bytes at `start`, just read; never waits for the hash. keep: None if `view`
        stays valid until hashed (the caller holds no reuse of it), else a function returning a private
        copy (taken only when the bytes are queued)."""
        view = memoryview(view).cast("B")
        end = start + len(view)
        with self.cond:
            self.claims.pop(start, None)
            if end > self.cursor and not self.finishing:
                if self.queued + len(view) <= QUEUE_BYTES:
                    data = view if keep is None else memoryview(keep()).cast("B")
                    heapq.heappush(self.queue, (start, self._seq, data))
                    self._seq += 1
                    self.queued += len(data)
                else:
                    self.dropped += len(view)
            self.cond.notify_all()

    def wait_covered(self, end: int) -> tuple[int, str]:
        """Wait until the bytes before `end` are hashed (what was not offered, e.g. a dropped piece, the
        digest reads); the prefix (offset, sha256) then."""
        with self.cond:
            self.want = max(self.want, end)
            self.cond.notify_all()
            while self.cursor < end and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            return self._snapshot()

    def covered_now(self, end: int) -> tuple[int, str] | None:
        """The prefix (offset, sha256) if the bytes before `end` are hashed already, else None."""
        with self.cond:
            if self.error is not None:
                raise self.error
            return self._snapshot() if self.cursor >= end else None

    # -- the digest's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    step = self._next_step()
                    while step is None:
                        self.cond.wait()
                        step = self._next_step()
                if step == "done":
                    return
                kind, a, b = step
                if kind == "hash":  # a queued piece at the cursor: hash it outside the lock
                    self._update(b[self.cursor - a :])
                    with self.cond:
                        self.queued -= len(b)
                        self.cond.notify_all()
                else:  # read the gap [cursor, b) ourselves, a chunk at a time
                    n = min(CHUNK, b - self.cursor)
                    data = os.pread(self._open(), n, self.cursor)
                    if not data:
                        raise OSError(f"{self.path}: file ended at {self.cursor} while it was being hashed")
                    self._update(memoryview(data))
                    with self.cond:
                        self.cond.notify_all()
        except BaseException as e:  # handed to wait_covered / finish
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            if self._fd is not None:
                os.close(self._fd)

    def _next_step(self) -> Any:
        """Under the lock: ('hash', start, view) | ('gap', cursor, until) | 'done' | None (wait)."""
        if self.abandoned:
            return "done"
        while self.queue and self.queue[0][0] + len(self.queue[0][2]) <= self.cursor:
            _, _, v = heapq.heappop(self.queue)  # read twice by the job: hashed already
            self.queued -= len(v)
        if self.queue and self.queue[0][0] <= self.cursor:
            start, _, view = heapq.heappop(self.queue)
            return ("hash", start, view)
        if any(s <= self.cursor < e for s, e in self.claims.items()):
            return None  # a reader is reading the cursor's bytes
        nxt = min([s for s in self.claims if s > self.cursor] + [s for s, _, _ in self.queue], default=None)
        if nxt is not None:
            return ("gap", self.cursor, nxt)
        if self.cursor < self.want:
            return ("gap", self.cursor, self.want)
        if self.finishing:
            size = os.fstat(self._open()).st_size
            return ("gap", self.cursor, size) if self.cursor < size else "done"
        return None  # nothing known ahead: the job's next reads will say

    def _open(self) -> int:
        if self._fd is None:
            # the job's file, opened once (not whatever the path names by now); no read-ahead: it would
            # fetch the readers' bytes
            self._fd = open_for_reads(self.path, self.inputs)
        return self._fd

    def _update(self, view: memoryview) -> None:
        """Hash `view` (the bytes at the cursor), checking the recorded prefix digest where it falls; in
        pieces, each under `hlock` with its cursor step, so that a snapshot's digest is the cursor's."""
        while True:
            self._check_here()
            if not len(view) or self.abandoned:
                return
            n = min(len(view), CHUNK)
            if self.check is not None and self.cursor < self.check[0]:
                n = min(n, self.check[0] - self.cursor)
            with self.hlock:
                self.h.update(view[:n])
                self.cursor += n
            view = view[n:]

    def _snapshot(self) -> tuple[int, str]:
        with self.hlock:
            return self.cursor, self.h.copy().hexdigest()

    def _check_here(self) -> None:
        if self.check is not None and self.check[0] == self.cursor:
            self.mismatch = self.h.copy().hexdigest() != self.check[1]
            self.check = None

    # -- the end ------------------------------------------------------------------------------------
    def finish(self) -> str:
        """The file's sha256 (the tail the job did not read is read here)."""
        with self.cond:
            self.finishing = True
            self.claims.clear()
            self.cond.notify_all()
        self._thread.join()
        if self.error is not None:
            raise self.error
        self._check_here()
        if self.check is not None:  # the file is now shorter than the prefix the interrupted run hashed
            self.mismatch = True
        return self.h.hexdigest()

    def abandon(self) -> None:
        """The job failed: stop hashing (not read the rest of the file) and wait for the thread. It may
        hold the job's torch buffers; a daemon thread doing so at the interpreter's exit aborts the process
        (qtool.io.hashed_writes.HashedWrites.stop)."""
        with self.cond:
            self.abandoned = True
            self.claims.clear()
            self.queue.clear()
            self.error = self.error or RuntimeError("abandoned")
            self.cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


class DigestSink(Protocol):
    """What a reader of the job's inputs hands its reads to, so that each input's sha256 comes from them;
    `inputs`: the job's input files, each opened once (qtool.io.input_files), which the reader reads through;
    None where no job opened them (the reader opens the path)."""

    inputs: InputFiles | None

    def claim(self, path: str, start: int, end: int) -> None:
        """The bytes [start, end) of `path` are about to be read (the digest waits for them)."""

    def offer(self, path: str, start: int, view: memoryview, keep: Callable[[], bytearray] | None = None) -> None:
        """The bytes of `path` at `start`, just read (FileDigest.offer)."""

    def release(self, path: str, start: int) -> None:
        """A claimed piece that will not be offered (its read failed): the digest reads it itself."""

    def queue_full(self, path: str, n: int) -> bool:
        """Whether an offer of `n` bytes of `path` now would be dropped (the digest would read them itself):
        a reader that bypasses the page cache reads such a piece through it instead, so that the digest
        finds it there rather than on the disk."""
        ...

    def covered(self, ends: dict[str, int], wait: bool = True) -> bool:
        """Wait until the bytes before each file's end in `ends` are hashed and on record (StreamDigests)."""
        ...


class NoDigests:
    """The sink of a job that hashes nothing from its reads."""

    inputs: InputFiles | None = None

    def claim(self, path: str, start: int, end: int) -> None:
        pass

    def offer(self, path: str, start: int, view: memoryview, keep: Callable[[], bytearray] | None = None) -> None:
        pass

    def release(self, path: str, start: int) -> None:
        pass

    def queue_full(self, path: str, n: int) -> bool:
        return False

    def covered(self, ends: dict[str, int], wait: bool = True) -> bool:
        return True


NO_DIGESTS = NoDigests()


class StreamDigests:
    """The files a job hashes from its own reads (realpath -> FileDigest): the DigestSink its readers get."""

    def __init__(
        self,
        on_snapshot: Callable[[dict[str, tuple[int, str]]], None] | None = None,
        settled: Callable[[bool], bool] | None = None,
        inputs: InputFiles | None = None,
    ) -> None:
        self.inputs = inputs  # the job's input files (DigestSink)
        self.files: dict[str, FileDigest] = {}
        self._real: dict[str, str] = {}
        self.lock = threading.Lock()
        self.on_snapshot = on_snapshot  # fn({realpath: (offset, prefix sha256)}): the resume record
        self.settled = (
            settled  # fn(wait) -> bool: (wait=True: wait) until the job's other inputs (hashed whole) are on record
        )
        self._last: dict[str, tuple[int, str]] = {}

    def add(self, path: str, check: tuple[int, str] | None = None) -> FileDigest:
        real = os.path.realpath(path)
        with self.lock:
            d = self.files.get(real)
            if d is None:
                d = self.files[real] = FileDigest(real, check, self.inputs)
            return d

    def get(self, path: str) -> FileDigest | None:
        """The digest fed by reads of `path`, when the job hashes it from its reads."""
        if not self.files:
            return None
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return self.files.get(real)

    # -- DigestSink ---------------------------------------------------------------------------------
    def claim(self, path: str, start: int, end: int) -> None:
        d = self.get(path)
        if d is not None:
            d.claim(start, end)

    def offer(self, path: str, start: int, view: memoryview, keep: Callable[[], bytearray] | None = None) -> None:
        d = self.get(path)
        if d is not None:
            d.offer(start, view, keep)

    def release(self, path: str, start: int) -> None:
        d = self.get(path)
        if d is not None:
            d.release(start)

    def queue_full(self, path: str, n: int) -> bool:
        d = self.get(path)
        if d is None:
            return False
        with d.cond:
            return d.queued + n > QUEUE_BYTES

    def covered(self, ends: dict[str, int], wait: bool = True) -> bool:
        """Wait until each file's bytes before its end in `ends` (path -> offset) are hashed, and the job's
        other inputs too (`settled`), then hand the prefixes to `on_snapshot`: what a unit about to be
        journaled used is then on record. wait=False: never wait for (nor make the digest read ahead to)
        those bytes; False if some are not hashed yet."""
        if self.settled is not None and not self.settled(wait):
            return False
        now = {}
        for path, end in ends.items():
            d = self.get(path)
            if d is None:
                continue
            if wait:
                now[d.path] = d.wait_covered(end)
            else:
                got = d.covered_now(end)
                if got is None:
                    return False
                now[d.path] = got
        with self.lock:
            new = {p: v for p, v in now.items() if v[0] > 0 and self._last.get(p) != v}
            self._last.update(new)
            if new and self.on_snapshot is not None:
                self.on_snapshot(new)
        return True

    def close(self) -> None:
        for d in self.files.values():
            d.abandon()

    def __enter__(self) -> StreamDigests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
