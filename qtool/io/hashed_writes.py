"""A file's sha256 computed from the bytes written to it, on a thread of its own, as they are written."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from typing_extensions import Buffer


class HashedWrites:
    """Writes buffers to a file in order and computes the file's sha256 on a thread of its own (hashlib
    releases the GIL), so the hash overlaps the writes and the writer never waits for it.

    The thread hashes the written buffers themselves, keeping at most `depth` of them alive. When it falls
    further behind (sha256 runs at ~1.2 GB/s on the H200 machine's cores, a layer shard is written at
    ~2.5 GB/s there), the buffers are let go and the thread goes on from the file (`path`), trailing the
    writer through the bytes just written (the page cache): the digest is ready about when the hash of the
    file would be, not a whole second read after the last write. `digest()` is that digest, a Future;
    without `path` a hash that falls behind gives up (the future holds None: the caller hashes the file).

    `keep_pace`: the writer waits for the hash instead, which never leaves the written buffers: for a file
    that nothing waits to write after it (the job's last layer shard), whose digest ends the job. Reading
    the file back costs the hash a copy and a pass over memory no cache holds: on the lent H100 machines
    the last shard's trailing hash ran at 0.76-0.80 GB/s beside the layer ahead's, against 1.17-1.44 GB/s
    for one core alone; on the 2-core VM, 64 MiB pieces read back from /dev/shm and hashed ran at 1.12 GiB/s,
    the buffers themselves at 1.43. The buffers are then kept until hashed: `depth` queued (one by default:
    the hash always has the next) and the one being hashed, besides the one the writer waits to queue."""

    # bytes the trailing hash reads at a time: each read and each update gives up the GIL and then waits
    # for it behind the job's busy main thread (up to the 5 ms switch interval): beside a busy Python
    # thread on the 2-core VM, 16 MiB pieces hashed at 0.62 GB/s, 64 MiB at 0.85 (alone: 0.97-0.99)
    READ = 64 << 20

    def __init__(
        self,
        file: BinaryIO,
        depth: int | None = None,
        path: str | os.PathLike | None = None,
        read: int | None = None,
        keep_pace: bool = False,
    ) -> None:
        if depth is None:
            depth = 1 if keep_pace else 4
        if keep_pace and depth < 1:
            raise ValueError("keep_pace needs room for one buffer (depth >= 1)")
        self.f = file
        self.h = hashlib.sha256()
        self.depth = depth
        self.keep_pace = keep_pace
        self.path = path
        self.read = read or self.READ  # the trailing hash's buffer (one per file being written)
        self.cond = threading.Condition()
        self.queue: deque = deque()  # buffers to hash; a None: from here on, trail the file
        self.written = 0  # bytes handed to the file so far (in order)
        self.flushed = 0  # of those, in the file (readable by the trailing hash)
        self.trailing_from: int | None = None
        self.closed = False  # no more writes: everything up to `written` is (or will be) flushed
        self.cancelled = False
        self.ended = False  # the hash thread is gone (done, stopped, or failed: the digest holds the error)
        self.future: Future = _Digest(self)
        self.behind = False
        # opened now: the writer renames the file once written, maybe before the hash reaches the file
        self.fd = os.open(path, os.O_RDONLY) if path is not None else None
        self.thread = threading.Thread(target=self._run, name="qtool-out-sha256", daemon=True)
        self.thread.start()

    def write(self, data: Buffer) -> None:
        n = memoryview(data).nbytes
        with self.cond:
            if not self.behind:
                if self.keep_pace:
                    while len(self.queue) >= self.depth and not (self.cancelled or self.ended):
                        self.cond.wait()  # until the hash takes a buffer
                    if not (self.cancelled or self.ended):  # stopped or failed: nothing hashes it
                        self.queue.append(data)
                elif len(self.queue) >= self.depth:
                    self._trail()
                else:
                    self.queue.append(data)
                self.cond.notify_all()
        self.f.write(data)
        with self.cond:
            self.written += n
            if self.behind:
                self.flushed = self._flushed()
                self.cond.notify()

    def grew(self) -> None:
        """Bytes reached the file past `write` (a kernel copy into its descriptor, after a flush): the hash
        reads them from the file, trailing it from wherever it stands."""
        with self.cond:
            if not self.behind:
                self._trail()
            # the descriptor's offset: a kernel copy moved it past anything `write` counted (buffered or not)
            self.written = self.flushed = os.lseek(self.f.fileno(), 0, os.SEEK_CUR)
            self.cond.notify()

    def _trail(self) -> None:
        """From here on the hash reads the file (call holding `cond`): the queued buffers are hashed from it
        instead (the one being hashed is not queued)."""
        self.behind = True
        self.trailing_from = self.written - sum(memoryview(b).nbytes for b in self.queue)
        self.queue.clear()
        self.queue.append(None)
        if self.path is None:
            self.future.set_result(None)  # no file to trail: the caller hashes it

    def _flushed(self) -> int:
        """Bytes of the file the OS holds: the written ones, less what the buffered writer still holds."""
        buffered = getattr(self.f, "raw", None) is not None
        return os.lseek(self.f.fileno(), 0, os.SEEK_CUR) if buffered else self.written

    def _run(self) -> None:
        fd, buf = self.fd, None
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed and not self.cancelled:
                        self.cond.wait()
                    if self.cancelled:
                        return
                    if not self.queue:
                        break  # closed, all hashed
                    item = self.queue.popleft()
                    self.cond.notify_all()  # a writer keeping pace waits for the room
                if item is not None:
                    self.h.update(item)
                    continue
                if self.path is None:
                    return  # fell behind (the future says None)
                pos = self.trailing_from or 0  # (set with the None queued: `_trail`)
                fd = self.fd if self.fd is not None else -1  # (opened wherever there is a path)
                while True:
                    with self.cond:
                        while (
                            pos >= self.flushed
                            and not (self.closed and self.flushed == self.written)
                            and not self.cancelled
                        ):
                            self.cond.wait()
                        if self.cancelled:
                            return
                        upto, last = self.flushed, self.closed and self.flushed == self.written
                    while pos < upto and not self.cancelled:
                        if buf is None:
                            buf = memoryview(bytearray(self.read))  # one buffer, not a new bytes per read
                        n = os.preadv(fd, [buf[: min(self.read, upto - pos)]], pos)
                        if not n:
                            raise OSError(f"{self.path}: shorter than the {upto} bytes written")
                        self.h.update(buf[:n])
                        pos += n
                    if self.cancelled:
                        return
                    if last and pos >= self.written:
                        break
                break
            if not self.future.done():
                self.future.set_result(self.h.hexdigest())
        except BaseException as e:  # noqa: BLE001 -- the digest's reader sees it
            if not self.future.done():
                self.future.set_exception(e)
        finally:
            with self.cond:
                self.ended = True
                self.cond.notify_all()  # a writer keeping pace waits no more
            if fd is not None:
                os.close(fd)

    def digest(self) -> Future[str | None]:
        """The file's sha256 as a Future (hexdigest str; None where the hash fell behind without `path`):
        flushes the writer's buffer; no write may follow."""
        self.f.flush()
        with self.cond:
            self.flushed = self._flushed() if self.behind else self.written
            if self.flushed != self.written:  # a seek or a write past this object: no digest of the file
                self.cancelled = True
                if not self.future.done():
                    self.future.set_exception(
                        OSError(
                            f"{self.path}: the file holds {self.flushed} bytes, {self.written} were written in order"
                        )
                    )
            self.closed = True
            self.cond.notify()
        return self.future

    def hexdigest(self) -> str | None:
        return self.digest().result()

    def stop(self) -> None:
        """Stop the hash and wait for its thread (an error path, before or after `digest`; after it, the
        digest's reader may cancel it instead): nothing of it may run on past an error. A daemon thread
        still running at the interpreter's exit is killed where it next takes the GIL; one holding or
        dropping a torch object there aborts the process ("terminate called without an active
        exception", pytorch#38228: CI saw it after a full disk)."""
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()  # the hash thread, and a writer keeping pace with it
        if self.thread is not threading.current_thread():
            self.thread.join()


class _Digest(Future):
    """HashedWrites' digest: cancelling it (a reader that no longer wants it, on an error path) stops the
    hash and waits for its thread."""

    def __init__(self, hashing: HashedWrites) -> None:
        super().__init__()
        self._hashing = hashing

    def cancel(self) -> bool:
        cancelled = super().cancel()
        self._hashing.stop()
        return cancelled
