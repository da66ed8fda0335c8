"""sha256 of input files from the bytes a job reads anyway: one read of the input, not two.

A layer-streamed job (quantize, calibrate-kv, eval kld) reads nearly all of its input once, layer by
layer, in file order. Hashing each input again in a thread of its own doubles what the disk must deliver
once the input no longer fits the page cache (an 800 GB 397B does not), so the readers feed what they read
to a `FileDigest`, which hashes it in file order:

- bytes at the digest's cursor are hashed at once (in the reading thread, before its buffer is reused);
- bytes ahead of the cursor wait while the bytes before them are claimed by another reader of the same
  layer (`claim`, made before the readers start, so the lowest piece always proceeds: no deadlock);
  bytes before them that nobody claimed (a tensor the job does not need, a header) are read by the digest
  itself, once: the gaps;
- bytes behind the cursor (read twice by the job) are already hashed;
- `finish` reads the tail the job did not need and returns the hex digest.

Resume: the run records, after each layer read, the digest of the prefix hashed so far
(`snapshots`); a resumed run, hashing again from the start, checks its own prefix digest at that offset,
so an input edited between the runs is refused even when the interrupted run never finished a full digest.

`StreamDigests.active` is the registry the readers look into (one per process: a job runs one output
transaction at a time); nothing is fed when no job registered the file.
"""

from __future__ import annotations

import hashlib
import os
import threading

CHUNK = 8 << 20  # gap and tail reads


class FileDigest:
    def __init__(self, path: str, check: tuple[int, str] | None = None) -> None:
        self.path = path
        self.h = hashlib.sha256()
        self.cursor = 0
        self.claims: dict[int, int] = {}  # start -> end of bytes a reader will feed
        self.cond = threading.Condition()
        self.gap_bytes = 0  # read by the digest itself (not needed by the job)
        # (offset, prefix sha256) the interrupted run recorded; `mismatch` is set when ours differs there
        self.check = check
        self.mismatch = False

    # -- readers ------------------------------------------------------------------------------------
    def claim(self, start: int, end: int) -> None:
        with self.cond:
            if end > start:
                self.claims[start] = max(end, self.claims.get(start, end))

    def release(self, start: int) -> None:
        """A claim that will not be fed (its reader failed)."""
        with self.cond:
            self.claims.pop(start, None)
            self.cond.notify_all()

    def feed(self, start: int, view) -> None:
        """`view`: the file's bytes at `start`, just read. Returns once they are hashed (or known not needed)."""
        view = memoryview(view).cast("B")
        end = start + len(view)
        with self.cond:
            self.claims.pop(start, None)
            while self.cursor < start:
                if self._claimed_at_cursor():
                    self.cond.wait()
                    continue
                nxt = min((s for s in self.claims if s > self.cursor), default=start)
                self._read_gap(min(start, nxt))
            if self.cursor < end:
                self._update(view[self.cursor - start:])
            self.cond.notify_all()

    def _claimed_at_cursor(self) -> bool:
        return any(s <= self.cursor < e for s, e in self.claims.items())

    def _update(self, view) -> None:
        """Hash `view` (the bytes at the cursor), checking the recorded prefix digest where it falls."""
        if self.check is not None and self.cursor <= self.check[0] < self.cursor + len(view):
            k = self.check[0] - self.cursor
            self.h.update(view[:k])
            self.cursor += k
            view = view[k:]
            self._check_here()
        self.h.update(view)
        self.cursor += len(view)

    def _check_here(self) -> None:
        if self.check is not None and self.check[0] == self.cursor:
            self.mismatch = self.h.copy().hexdigest() != self.check[1]
            self.check = None

    def _read_gap(self, until: int) -> None:
        """Hash [cursor, until) read from the file (bytes no reader claimed)."""
        fd = os.open(self.path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # read-ahead would fetch the readers' bytes
        try:
            while self.cursor < until:
                n = min(CHUNK, until - self.cursor)
                data = os.pread(fd, n, self.cursor)
                if not data:
                    raise OSError(f"{self.path}: file ended at {self.cursor} while it was being hashed")
                self.gap_bytes += len(data)
                self._update(memoryview(data))
        finally:
            os.close(fd)

    # -- the end ------------------------------------------------------------------------------------
    def prefix(self) -> tuple[int, str]:
        with self.cond:
            return self.cursor, self.h.copy().hexdigest()

    def finish(self) -> str:
        """The file's sha256 (the tail the job did not read is read here)."""
        with self.cond:
            self.claims.clear()
            self._read_gap(os.path.getsize(self.path))
            self._check_here()
            if self.check is not None:  # the file is now shorter than the prefix the interrupted run hashed
                self.mismatch = True
            return self.h.hexdigest()


class StreamDigests:
    """The files this process's job hashes from its own reads (realpath -> FileDigest)."""

    active: StreamDigests | None = None

    def __init__(self, on_snapshot=None) -> None:
        self.files: dict[str, FileDigest] = {}
        self._real: dict[str, str] = {}
        self.lock = threading.Lock()
        self.on_snapshot = on_snapshot  # fn({realpath: (offset, prefix sha256)}): the resume record
        self._last: dict[str, tuple[int, str]] = {}

    def add(self, path: str, check: tuple[int, str] | None = None) -> FileDigest:
        real = os.path.realpath(path)
        with self.lock:
            d = self.files.get(real)
            if d is None:
                d = self.files[real] = FileDigest(real, check)
            return d

    def get(self, path: str) -> FileDigest | None:
        if not self.files:
            return None
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return self.files.get(real)

    def snapshot(self) -> None:
        """Hand the prefixes hashed since the last call to `on_snapshot` (after each layer read: every
        byte a finished layer used is in them)."""
        if self.on_snapshot is None:
            return
        with self.lock:
            now = {p: d.prefix() for p, d in self.files.items()}
            new = {p: v for p, v in now.items() if v[0] > 0 and self._last.get(p) != v}
            self._last.update(new)
        if new:
            self.on_snapshot(new)

    def __enter__(self) -> StreamDigests:
        StreamDigests.active = self
        return self

    def __exit__(self, *exc) -> None:
        StreamDigests.active = None


def digest_of(path: str) -> FileDigest | None:
    """The digest fed by reads of `path`, when the running job hashes it from its reads."""
    reg = StreamDigests.active
    return None if reg is None else reg.get(path)


def claim(path: str, start: int, end: int) -> None:
    d = digest_of(path)
    if d is not None:
        d.claim(start, end)


def feed(path: str, start: int, view) -> None:
    d = digest_of(path)
    if d is not None:
        d.feed(start, view)


def release(path: str, start: int) -> None:
    d = digest_of(path)
    if d is not None:
        d.release(start)


def snapshot() -> None:
    reg = StreamDigests.active
    if reg is not None:
        reg.snapshot()
