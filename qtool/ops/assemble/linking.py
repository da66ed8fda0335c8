"""Put an unchanged shard into the output without rewriting its bytes: reflink (FICLONE, btrfs/xfs),
hardlink (same filesystem), else a kernel-side copy (copy_file_range). `auto` tries them in that order and
remembers what failed, so a 100-shard job probes each method once."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

from qtool.errors import WriteError
from qtool.ops.assemble.plan import LinkMode

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h


def reflink(src: str, dst: str) -> bool:
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
            os.fsync(d.fileno())
        return True
    except OSError:
        if os.path.exists(dst):
            os.unlink(dst)
        return False


def hardlink(src: str, dst: str) -> bool:
    try:
        os.link(os.path.realpath(src), dst)
        return True
    except OSError:
        return False


def copy(src: str, dst: str, stop: threading.Event | None = None) -> bool:
    from qtool.io.writer import copy_range

    size = os.path.getsize(src)
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            copy_range(s.fileno(), d.fileno(), 0, size, stop)
            os.fsync(d.fileno())
    except OSError as e:
        hint = "free disk space or choose another output directory" if e.errno == errno.ENOSPC else None
        raise WriteError(f"copying a shard failed: {e.strerror}", path=dst, hint=hint) from None
    return True


_ORDER = {
    LinkMode.AUTO: ("reflink", "hardlink", "copy"),
    LinkMode.REFLINK: ("reflink",),
    LinkMode.HARDLINK: ("hardlink",),
    LinkMode.COPY: ("copy",),
}
_FUNCS = {"reflink": reflink, "hardlink": hardlink, "copy": copy}


class Linker:
    def __init__(self, mode: LinkMode, stop: threading.Event | None = None) -> None:
        self.mode = mode
        self.stop = stop  # copies end early (writer.Interrupted) once set
        self.failed: set[str] = set()  # methods that did not work here; several writer threads add to it

    def place(self, src: str, dst: str) -> str:
        """Put `src` at `dst`; returns the method used."""
        if os.path.lexists(dst):
            os.unlink(dst)
        for method in _ORDER[self.mode]:
            if method in self.failed:
                continue
            if (copy(src, dst, self.stop) if method == "copy" else _FUNCS[method](src, dst)):
                return method
            self.failed.add(method)
        raise WriteError(
            f"--link {self.mode.value} is not possible here",
            path=dst,
            hint="the output must be on the same filesystem as the source for hardlinks, and on btrfs/xfs "
            "for reflinks; use --link auto or --link copy",
        )

    def expect_new_bytes(self, src: str, out_dir: str) -> bool:
        """Whether placing `src` will (probably) consume new disk space."""
        if self.mode is LinkMode.COPY:
            return True
        try:
            same_fs = os.stat(os.path.realpath(src)).st_dev == os.stat(out_dir).st_dev
        except OSError:
            return True
        return not same_fs
