"""A job's input files, each opened once as a regular file and read through that descriptor; at commit each
is checked against its identity at open, so an input changed while the job ran fails the job, naming the
file, instead of giving an output (or a digest) that belongs to no file.

Why one descriptor: a path is only a name. A shard renamed over, turned into a FIFO or a link to
/dev/zero while a 400 GB job reads it would give each later open of the path another file (or a hang,
or endless zeros); every reader of the job (the layer readers, the digest's own reads, a link or copy
into the output) takes its descriptor from here instead: a `dup` of the one opened (`open_for_reads`), or
the file itself for a link (`placing`). The identity (device, inode, size, mtime, ctime) is taken by one
fstat at open and one at commit (`check`); nothing per read. The kernel moves the ctime on every change of
the file, and no user tool can put it back; qtool's own hard links into the output move it too, so a link
made here (`placing`) takes the ctime it leaves as the file's, when nothing else about it moved, and a
ctime that moved with the link count (a link made or removed elsewhere) is not a change of the bytes.

The job's `InputFiles` is handed to its readers as an object, with the digests they feed
(qtool.io.stream_digest.DigestSink.inputs, made by qtool.io.manifest.InputHasher, which opens each input as it
is submitted, before the job's first read); for a file it does not hold (not an input: the job's own output),
or where no job runs (`inputs` None), `open_for_reads` opens the path, still only as a regular file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from qtool.errors import CheckpointError
from qtool.io import files

O_DIRECT = getattr(os, "O_DIRECT", 0)


def identity(stat: os.stat_result) -> tuple[int, int, int, int, int]:
    """What says a file is the same file with the same bytes: device, inode, size, mtime, ctime."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


@dataclass
class OpenInput:
    path: str  # the real path
    fd: int
    stat: os.stat_result  # at open, or as qtool's own link left it (`placing`)
    direct: int | None = None
    direct_tried: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # one placing of it at a time


class InputChanged(CheckpointError):
    """An input file changed while the job read it."""


class InputFiles:
    """The job's input files (real path -> OpenInput), each opened once."""

    def __init__(self) -> None:
        self.files: dict[str, OpenInput] = {}
        self._real: dict[str, str] = {}
        self.lock = threading.RLock()

    def open(self, path: str | os.PathLike) -> OpenInput:
        """The input at `path`, opened now if it is not yet (a regular file only: a FIFO, a device or a
        directory is a CheckpointError naming it, never a hang)."""
        real = self._real_of(os.fspath(path))
        f = self.files.get(real)
        if f is not None:
            return f
        with self.lock:
            f = self.files.get(real)
            if f is None:
                fd = files.open_for_reads(real)
                f = self.files[real] = OpenInput(real, fd, os.fstat(fd))
            return f

    def known(self, path: str) -> OpenInput | None:
        """The input at `path` if the job opened it (any other file it reads, e.g. its own output, is not
        one of its inputs)."""
        return self.files.get(self._real_of(path))

    def _real_of(self, path: str) -> str:
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return real

    def direct_fd(self, path: str) -> int | None:
        """A descriptor of the same file that reads around the page cache (O_DIRECT), or None where the
        filesystem has none: reopened through /proc/self/fd, so the file opened at first, not the path."""
        f = self.open(path)
        if f.direct_tried:
            return f.direct
        with self.lock:
            if not f.direct_tried:
                f.direct = _reopen_direct(f.fd)
                f.direct_tried = True
        return f.direct

    @contextmanager
    def placing(self, path: str | os.PathLike) -> Iterator[int]:
        """Around a link or copy of the input into the output: the descriptor of the file checked (the
        output gets that file, whatever the path names now), refused if it changed already; the ctime
        qtool's own link leaves is the file's from then on, if its device, inode, size and mtime stay."""
        f = self.open(path)
        with f.lock:
            self._refuse_changed(f)
            yield f.fd
            now = os.fstat(f.fd)
            if identity(now)[:4] == identity(f.stat)[:4]:
                f.stat = now

    def changed(self) -> list[str]:
        """The inputs whose file changed since they were opened (written, truncated, or another file now at
        their path)."""
        with self.lock:
            return [f.path for f in self.files.values() if _changed(f)]

    def unchanged(self, path: str) -> bool:
        """Whether the input at `path` (opened) is still the file opened, bytes unchanged."""
        return not _changed(self.open(path))

    def check_one(self, path: str) -> None:
        """InputChanged if `path` is an input of the job that changed (a read that found it ended early asks:
        the file shrank under the job, not a shard truncated before it began)."""
        f = self.known(path)
        if f is not None:
            self._refuse_changed(f)

    def check(self) -> None:
        """At commit: every input is still the file the job opened, unchanged; else InputChanged naming it."""
        for f in list(self.files.values()):
            self._refuse_changed(f)

    def _refuse_changed(self, f: OpenInput) -> None:
        if _changed(f):
            raise InputChanged(
                "an input file changed while the job read it: the output would belong to no version of it",
                path=f.path,
                hint="run again once nothing writes the input (a download, a sync, a copy "
                "into the checkpoint); the output was not published",
            )

    def close(self) -> None:
        with self.lock:
            for f in self.files.values():
                for fd in (f.fd, f.direct):
                    if fd is not None:
                        os.close(fd)
            self.files.clear()
            self._real.clear()


def _changed(f: OpenInput) -> bool:
    try:
        at_path = os.stat(f.path)
    except OSError:
        return True
    now, then = os.fstat(f.fd), f.stat
    if (at_path.st_dev, at_path.st_ino) != (now.st_dev, now.st_ino) or identity(now)[:4] != identity(then)[:4]:
        return True
    # a ctime moved with the link count is a link made or removed (qtool's own in its output: an in-place
    # run's new state drops its link of a shard it rewrites; an old output's removal), not new bytes
    return now.st_ctime_ns != then.st_ctime_ns and now.st_nlink == then.st_nlink


def _reopen_direct(fd: int) -> int | None:
    if not O_DIRECT:
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | O_DIRECT | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOENT, errno.EACCES):  # no direct reads here, or no /proc
            return None
        raise
    if (os.fstat(direct).st_dev, os.fstat(direct).st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
        os.close(direct)  # (not the file: a /proc that is not this process's)
        return None
    fcntl.fcntl(direct, fcntl.F_SETFL, fcntl.fcntl(direct, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return direct


def open_for_reads(path: str, inputs: InputFiles | None) -> int:
    """A read descriptor of `path` for a reader that closes it: the job's input (`inputs`: a dup of the one
    descriptor it opened), else the path opened now; regular files only (qtool.io.files.open_for_reads)."""
    f = inputs.known(path) if inputs is not None else None
    return os.dup(f.fd) if f is not None else files.open_for_reads(path)


def open_direct(path: str, inputs: InputFiles | None) -> int | None:
    """A descriptor that reads `path` around the page cache, for a reader that closes it, or None where
    there are no direct reads: the job's file (`inputs`), else the path opened now (a regular file only)."""
    if inputs is not None and inputs.known(path) is not None:
        fd = inputs.direct_fd(path)
        return None if fd is None else os.dup(fd)
    if not O_DIRECT:
        return None
    fd = files.open_for_reads(path)  # (the regular-file check, without blocking on a FIFO)
    try:
        return _reopen_direct(fd)
    finally:
        os.close(fd)
