"""Creating and placing files the one safe way (qtool.io.output builds directories on top of this):

- a file is never opened for writing if it already exists: it is unlinked first and created with O_EXCL,
  so a hard link to a source (what `Placer` makes for unchanged shards) can never be written through,
  whatever a resumed or crashed run left behind;
- unchanged inputs are placed by reflink, hard link or a kernel-side copy (`Placer`, the only link helper);
- OSErrors become WriteErrors with the fix for full or read-only disks (`write_error`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import CheckpointError, Interrupted, UsageError, WriteError

if TYPE_CHECKING:
    from qtool.io.input_files import InputFiles

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h


class LinkMode(str, Enum):
    """How an unchanged input file is put into an output (--link)."""

    AUTO = "auto"  # reflink, else hardlink, else copy
    REFLINK = "reflink"
    HARDLINK = "hardlink"
    SYMLINK = "symlink"  # download only: a link into the Hugging Face cache
    COPY = "copy"
    OWN_INODE = "own-inode"  # reflink, else copy: never an inode shared with the source (build's publish)


def _no_space_hint(e: OSError) -> str | None:
    return "free disk space or choose another output directory" if e.errno == errno.ENOSPC else None


def write_error(what: str, error: OSError, path: str | Path) -> WriteError:
    """A WriteError for an OSError, with the fix for the common causes (full or read-only disk)."""
    hint = _no_space_hint(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "the directory is not writable: choose another output directory (-o) or fix its permissions"
    return WriteError(f"{what}: {error.strerror}", path=path, hint=hint)


def require_text_path(path: str | Path, flag: str) -> None:
    """A path qtool will write into a text file (a recipe, a table, a page, a manifest) must be UTF-8: a name
    with other bytes (Python carries them as lone surrogates) cannot be written as text, and would only fail
    at the end of the job. A usage error naming the flag, before any work."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise UsageError(
            f"{flag}: the path is not UTF-8 text (qtool writes it into its output)",
            got=shown,
            hint="rename the file or directory to a UTF-8 name",
        ) from None


def open_new(path: str | Path, mode: int = 0o644) -> int:
    """A descriptor for writing a NEW file at `path`: an existing file (or a link to a source inode) is
    unlinked first, never truncated or written through."""
    if os.path.lexists(path):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


@contextmanager
def new_file(path: str | Path, mode: int = 0o644) -> Iterator:
    """`open_new` as a binary file object; fsynced on success, removed on failure."""
    fd = open_new(path, mode)
    f = os.fdopen(fd, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
    except BaseException:
        f.close()
        if os.path.lexists(path):
            os.unlink(path)
        raise
    f.close()


def _reflink(src: str, fd: int, dst: str, mode: int, stop: threading.Event | None) -> bool:
    try:
        with new_file(dst, mode) as d:
            fcntl.ioctl(d.fileno(), FICLONE, fd)
        return True
    except OSError:
        return False


def _hardlink(src: str, fd: int, dst: str, mode: int, stop: threading.Event | None) -> bool:
    """A link to the file open at `fd`, not to whatever its path names by now: through /proc (linkat's
    AT_SYMLINK_FOLLOW, no privilege needed), else by path and kept only if it is that file."""
    try:
        if os.path.lexists(dst):
            os.unlink(dst)
        try:
            os.link(f"/proc/self/fd/{fd}", dst)
        except OSError:  # (no /proc, or a kernel that refuses it: a sandbox's)
            os.link(os.path.realpath(src), dst)
        linked, opened = os.stat(dst), os.fstat(fd)
        if (linked.st_dev, linked.st_ino) != (opened.st_dev, opened.st_ino):
            os.unlink(dst)  # another file at the path now: a copy of the file opened instead
            return False
        return True
    except OSError:
        return False


def _symlink(src: str, fd: int, dst: str, mode: int, stop: threading.Event | None) -> bool:
    try:
        if os.path.lexists(dst):
            os.unlink(dst)
        os.symlink(os.path.realpath(src), dst)
        return True
    except OSError:
        return False


TMP_SUFFIX = ".qtool-tmp"  # every temporary file qtool makes ends so; a commit sweeps leftovers


def tmp_path(path: str | Path) -> Path:
    """The hidden temporary name next to `path` that a file is written under before its rename."""
    path = Path(path)
    return path.with_name("." + path.name + TMP_SUFFIX)


INPUT_DIGESTS = ".qtool-input-digests.jsonl"  # qtool.io.manifest.InputHasher's record, in OUT.partial/


STOPPED = "a copy stopped on request (another shard failed, or the run was interrupted)"
COPY_CHUNK = 256 << 20  # per copy_file_range call: also how often a stop request is looked at


def copy_range(
    src_fd: int,
    dst_fd: int,
    start: int,
    count: int,
    stop: threading.Event | None = None,
    copied: Callable[[], None] | None = None,
) -> None:
    """Kernel-side copy (copy_file_range: reflinks on btrfs/xfs, no user-space buffers); falls back to
    a chunked read/write where the kernel or filesystem refuses. Raises Interrupted between chunks once
    `stop` is set; calls `copied()` after each chunk (a hash trailing the copy reads what it wrote)."""
    offset = start
    remaining = count
    if hasattr(os, "copy_file_range"):
        try:
            while remaining > 0:
                if stop is not None and stop.is_set():
                    raise Interrupted(STOPPED)
                n = os.copy_file_range(src_fd, dst_fd, min(remaining, COPY_CHUNK), offset)
                if n == 0:
                    break
                offset += n
                remaining -= n
                if copied is not None:
                    copied()
        except OSError as e:
            if e.errno == 28:  # ENOSPC
                raise
    chunk = 8 << 20
    while remaining > 0:
        if stop is not None and stop.is_set():
            raise Interrupted(STOPPED)
        buf = os.pread(src_fd, min(chunk, remaining), offset)
        if not buf:
            raise OSError(5, "source file ended early")
        os.write(dst_fd, buf)
        offset += len(buf)
        remaining -= len(buf)
        if copied is not None:
            copied()


def copy_file(src: str | Path, dst: str | Path, mode: int = 0o644) -> None:
    """Copy `src` to a NEW file `dst` (kernel-side, fsynced): side files and small inputs."""
    with _opened(str(src)) as fd:
        _copy(str(src), fd, str(dst), mode, None)


def _copy(
    src: str, fd: int, dst: str, mode: int, stop: threading.Event | None, on_header: Callable[[], None] | None = None
) -> bool:
    """A kernel-side copy into a NEW file, fsynced. on_header: called once the copy holds the source's
    safetensors header (copied first), so that checks reading only headers need not wait for the data (once
    the copy is done where the file has no header)."""
    size = os.fstat(fd).st_size
    try:
        with new_file(dst, mode) as d:
            head = _safetensors_header_end(fd, size) if on_header is not None else 0
            if head and on_header is not None:
                copy_range(fd, d.fileno(), 0, head, stop)
                on_header()
            copy_range(fd, d.fileno(), head, size - head, stop)
    except OSError as e:
        raise write_error("copying a file failed", e, dst) from None
    if on_header is not None and not head:  # no header to copy first: told once the copy is whole
        on_header()
    return True


def _safetensors_header_end(fd: int, size: int) -> int:
    """Where the header of the safetensors file open at `fd` ends (its 8-byte length, then the JSON), or
    0 where the file is too short to be one."""
    first = os.pread(fd, 8, 0)
    if len(first) < 8:
        return 0
    end = 8 + int.from_bytes(first, "little")
    return end if end <= size else 0


@contextmanager
def _opened(src: str) -> Iterator[int]:
    fd = open_regular(src)
    try:
        yield fd
    finally:
        os.close(fd)


_ORDER = {
    LinkMode.AUTO: ("reflink", "hardlink", "copy"),
    LinkMode.REFLINK: ("reflink",),
    LinkMode.HARDLINK: ("hardlink",),
    LinkMode.SYMLINK: ("symlink",),
    LinkMode.COPY: ("copy",),
    LinkMode.OWN_INODE: ("reflink", "copy"),
}
_METHODS = {"reflink": _reflink, "hardlink": _hardlink, "symlink": _symlink, "copy": _copy}


class Placer:
    """Puts unchanged input files into an output: the only link/copy helper. `auto` remembers what
    failed, so a 100-shard job probes each method once (several writer threads share one Placer)."""

    def __init__(
        self, mode: LinkMode = LinkMode.AUTO, stop: threading.Event | None = None, file_mode: int = 0o644
    ) -> None:
        self.mode = LinkMode(mode)
        self.stop = stop  # copies end early (errors.Interrupted) once set
        self.file_mode = file_mode
        self.failed: set[str] = set()
        # the job's input files (qtool.io.input_files.InputFiles), set by its executor: a file is placed from
        # the one the job opened and checks at commit, not from whatever its path names by then
        self.sources: InputFiles | None = None

    def place(self, src: str | Path, dst: str | Path, on_header: Callable[[], None] | None = None) -> str:
        """Put `src` at `dst` (durable on return); returns the method used. on_header: called once `dst`
        holds the safetensors header of `src` (a copy's comes first, before its data)."""
        src, dst = str(src), str(dst)
        with self._source(src) as fd:
            for method in _ORDER[self.mode]:
                if method in self.failed:
                    continue
                if method == "copy" and on_header is not None:
                    placed = _copy(src, fd, dst, self.file_mode, self.stop, on_header)
                    on_header = None  # told by the copy
                else:
                    placed = _METHODS[method](src, fd, dst, self.file_mode, self.stop)
                if placed:
                    if on_header is not None:
                        on_header()
                    return method
                self.failed.add(method)
        raise WriteError(
            f"--link {self.mode.value} is not possible here",
            path=dst,
            hint="the output must be on the same filesystem as the source for hardlinks, and on btrfs/xfs "
            "for reflinks; use --link auto or --link copy",
        )

    def copy(self, src: str | Path, dst: str | Path) -> None:
        """`copy_file` from the job's input file (see `place`)."""
        with self._source(str(src)) as fd:
            _copy(str(src), fd, str(dst), self.file_mode, self.stop)

    def _source(self, src: str) -> AbstractContextManager[int]:
        return self.sources.placing(src) if self.sources is not None else _opened(src)

    def expect_new_bytes(self, src: str | Path, out_dir: str | Path) -> bool:
        """Whether placing `src` will (probably) consume new disk space."""
        if self.mode in (LinkMode.COPY, LinkMode.OWN_INODE):
            return True
        if self.mode is LinkMode.SYMLINK:
            return False
        try:
            same_fs = os.stat(os.path.realpath(src)).st_dev == os.stat(out_dir).st_dev
        except OSError:
            return True
        return not same_fs


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem holding `path` (what a refusal for want of space names)."""
    p = Path(os.path.realpath(path))
    while not os.path.ismount(p):
        p = p.parent
    return p


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames and links in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: str | Path, what: str = "file", error: type | None = None) -> int:
    """A read descriptor for `path` only if it is a regular file: opened with O_NONBLOCK first, so a FIFO
    (or a device) named like a shard or a config is refused at once instead of hanging the run; a
    directory, a symlink loop or a missing file is a CheckpointError (or `error`, a subclass) naming the
    path."""
    err = error or CheckpointError
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise err(f"{what} not found", path=path, hint="restore it (or re-download the checkpoint)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise err(f"{what} is a symlink loop", path=path, hint="point the link at a real file") from None
        if e.errno == errno.EISDIR:
            raise err(f"{what} is a directory, not a file", path=path) from None
        raise err(f"cannot open {what}: {e.strerror}", path=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise err(
            f"{what} is {kind}, not a regular file",
            path=path,
            hint="replace it with the real file (qtool reads only regular files)",
        )
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular(path: str | Path, what: str = "file", error: type | None = None) -> bytes:
    """The bytes of a regular file (`open_regular`'s checks)."""
    with os.fdopen(open_regular(path, what, error), "rb") as f:
        return f.read()


def keep_newest(folder: Path, pattern: str, keep: int, spare: Path | None = None) -> None:
    """Remove the files of `folder` matching `pattern` but the `keep` with the latest mtime (qtool's caches:
    a use that should count touches its file) and `spare` (the one just written). Safe beside other runs
    doing the same."""
    found = []
    for p in folder.glob(pattern):
        try:
            found.append((p.stat().st_mtime_ns, p))
        except OSError:
            continue  # removed meanwhile by another run
    for _, p in sorted(found, reverse=True)[keep:]:
        if p != spare:
            p.unlink(missing_ok=True)


def open_for_reads(path: str) -> int:
    """A descriptor for large explicit reads: the kernel's read-ahead is turned off (POSIX_FADV_RANDOM),
    since every byte it would fetch ahead is asked for anyway, and pages it fetched early are the first
    to go when the input does not fit the page cache (read twice from the disk, then). A regular file only
    (`open_regular`: a FIFO or a device put at an input's path is a named error, not a hang)."""
    fd = open_regular(path, "input file")
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class HashStopped(Exception):
    """hash_file was stopped (its job failed or was interrupted): no digest."""


def hash_file(path: str | Path, chunk: int = 8 << 20, stop: threading.Event | None = None) -> str:
    """The file's sha256; once `stop` is set, HashStopped within a chunk (a failed job's exit does not wait
    for the rest of a 5 GB input shard)."""
    fd = open_regular(path)
    try:
        return hash_fd(fd, str(path), chunk, stop)
    finally:
        os.close(fd)


def hash_fd(fd: int, path: str, chunk: int = 8 << 20, stop: threading.Event | None = None) -> str:
    """The sha256 of the file open at `fd` (read by offset: a descriptor shared with other readers)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    offset = 0
    while True:
        if stop is not None and stop.is_set():
            raise HashStopped(path)
        n = os.preadv(fd, [view], offset)
        if not n:
            break
        h.update(view[:n])
        offset += n
    return h.hexdigest()


def hash_ranges_fd(
    fd: int, path: str, ranges: Iterable[tuple[int, int]], chunk: int = 8 << 20, stop: threading.Event | None = None
) -> str:
    """The sha256 of the bytes of `ranges` (in the order given) of the file open at `fd`."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    for start, end in ranges:
        offset = start
        while offset < end:
            if stop is not None and stop.is_set():
                raise HashStopped(path)
            n = os.preadv(fd, [view[: min(chunk, end - offset)]], offset)
            if not n:
                raise OSError(errno.EIO, f"{path} ended at byte {offset}, before the {end} the job takes")
            h.update(view[:n])
            offset += n
    return h.hexdigest()


def link_tree(
    src: Path,
    dst: Path,
    placer: Placer,
    *,
    keep_existing: bool = False,
    skip: Iterable[str] = (),
    relative_links: bool = False,
) -> None:
    """Place every file under `src` at the same relative path under `dst`: symlinks (to files or
    directories) as links, made absolute unless `relative_links` (dst a sibling of src, where relative
    targets resolve alike: an HF snapshot's `../../blobs/...`); with `keep_existing`, files already at
    `dst` are kept (a resumed run's work). `skip`: names left out."""
    skip = set(skip)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for d in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            dirnames.remove(d)  # a symlinked directory is placed as the link it is, not walked
            filenames.append(d)
        for f in filenames:
            if f in skip:
                continue
            target = dst / rel / f
            if keep_existing and os.path.lexists(target):
                continue
            s = os.path.join(dirpath, f)
            if os.path.islink(s):
                if os.path.lexists(target):
                    os.unlink(target)
                os.symlink(os.readlink(s) if relative_links else os.path.realpath(s), target)
            else:
                placer.place(s, target)
