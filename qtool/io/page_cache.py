"""Whether a file's bytes are in the page cache already, from the kernel's `cachestat` (Linux 6.5+).

The layer reader reads around the page cache (`O_DIRECT`) so that an input larger than memory is read from
the disk once. Bytes the page cache holds already (a re-run on an input that fits memory, the output the
previous job just wrote) are copied from there instead: a direct read would fetch them from the disk again,
at the disk's speed (measured on an H100 machine's disk: a cached 31 GB quantize took 30.3 s with direct
reads against 18.7 s through the page cache).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

_SYS_CACHESTAT = 451  # the same number on every architecture (the generic table's, Linux 6.5)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# False once the kernel said it has no cachestat (older than 6.5); the number is Linux's only
_available = sys.platform == "linux"


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether every page of bytes [offset, offset + length) of `fd` is in the page cache (False where the
    kernel cannot say)."""
    global _available
    if not _available or length <= 0:
        return False
    first, end = offset // _PAGE, -(-(offset + length) // _PAGE)
    rng, st = _Range(first * _PAGE, (end - first) * _PAGE), _Stat()
    if (
        _libc.syscall(
            ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)
        )
        != 0
    ):
        # ENOSYS: no cachestat in this kernel (nor will there be for the next file). EPERM is the file's:
        # like mincore, cachestat answers only a caller who may write the file or owns it
        if ctypes.get_errno() == errno.ENOSYS:
            _available = False
        return False
    return st.nr_cache >= end - first


def available() -> bool:
    """Whether this kernel answers `resident` (tests of the choice it makes skip where it does not)."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        f.write(b"x")
        f.flush()
        resident(f.fileno(), 0, 1)
    return _available
