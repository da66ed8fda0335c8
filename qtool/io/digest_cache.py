"""The persistent sha256 cache of local input files (`$QTOOL_CACHE_DIR/sha256-cache.json`), used by
qtool.io.manifest.InputHasher so that a re-run does not read hundreds of GB again to hash them.

An entry is found by path, device, inode, size and mtime, and is trusted only while the file's ctime is
the one recorded: the kernel moves the ctime on every change of the file and no user tool can put it back
the way `touch -d`, `cp -p` or `rsync -t` put back an mtime, so a same-size edit with the mtime restored is
hashed again, whatever else happened to the file. A link made or removed moves the ctime too; qtool's own
links into an output are made during a run, so at the end of the run the entries of the files it hashed or
found are re-recorded with their ctime of then (`refresh`): the next run does not read them again. (A
link made or removed between runs, e.g. `rm -rf` of an old output, costs one re-hash, never a wrong digest.)
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qtool.errors import QtoolError
from qtool.io.files import open_regular
from qtool.notices import tell

# Entries kept: a 397B's input and outputs are ~200 files, so this is dozens of models' worth. Unbounded,
# the cache grew by every file any run ever hashed (a day of this project's tests: 55k entries, 13 MB, of
# which 97% named files long gone), and every job pays its load and save: 0.14 + 0.42 s on the 2-core VM.
MAX_ENTRIES = 8192
MAX_BYTES = 64 << 20  # MAX_ENTRIES entries take ~2 MB: a larger file is not the cache qtool writes
LOCK_WAIT = 5.0  # seconds a save waits for another job's save before it gives up on its own


def file_key(real: str, stat: os.stat_result | None = None) -> str:
    stat = stat or os.stat(real)
    return f"{real}|{stat.st_dev}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"


def user_cache() -> DigestCache:
    """The cache under qtool's cache dir (`$QTOOL_CACHE_DIR/sha256-cache.json`)."""
    from qtool.cache import cache_dir

    return DigestCache(cache_dir() / "sha256-cache.json")


def files_in(root: Path) -> list[Path]:
    """The regular files directly in `root` (a checkpoint's shards, configs): what its users link."""
    try:
        return [f for f in root.iterdir() if f.is_file() and not f.is_symlink()]
    except OSError:
        return []


def _load(path: Path) -> dict[str, dict]:
    text = _read_bounded(path)
    if text is None:
        return {}
    try:
        loaded = json.loads(text)
    except ValueError:
        return {}
    # entries of the older string form (keyed without the ctime) prove nothing: dropped
    return {k: v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}


def _read_bounded(path: Path) -> bytes | None:
    """The cache file's bytes if it is a regular file of at most MAX_BYTES, else None: a FIFO or a device
    at its name (a link to /dev/zero) is ignored with a warning, never read (a hang, or memory without end)."""
    try:
        fd = open_regular(path, "the sha256 cache")
    except QtoolError as e:
        if os.path.lexists(path):
            tell(f"warning: {e.message} ({path}): ignored; remove it (qtool writes a new one)")
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_BYTES:
            tell(
                f"warning: the sha256 cache is {size} bytes, more than qtool ever writes ({path}): ignored; "
                "remove it (qtool writes a new one)"
            )
            return None
        return os.pread(fd, size + 1, 0)[:MAX_BYTES]
    except OSError:
        return None
    finally:
        os.close(fd)


class DigestCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict] = _load(path)
        self.lock = threading.Lock()
        self.changed: dict[str, dict] = {}  # what this object put since its last save: all `save` writes

    @property
    def dirty(self) -> bool:
        return bool(self.changed)

    def lookup(self, real: str, stat: os.stat_result | None = None) -> str | None:
        """The cached sha256 of `real` (a resolved path; `stat`: its stat, taken by a caller that keys
        something else by it), or None when it must be hashed."""
        stat = stat or os.stat(real)
        e = self.entries.get(file_key(real, stat))
        if e is not None and isinstance(e.get("sha256"), str) and e.get("ctime") == stat.st_ctime_ns:
            return e["sha256"]
        return None

    def store(self, real: str, digest: str, before: os.stat_result) -> None:
        """Record `digest`, hashed from `real` whose stat was `before` when the read began, if the file did not
        change meanwhile (changed at all: its ctime too)."""
        after = os.stat(real)
        if file_key(real, after) == file_key(real, before) and after.st_ctime_ns == before.st_ctime_ns:
            self._put(file_key(real, after), digest, after.st_ctime_ns)

    def record(self, real: str, digest: str, size: int | None) -> None:
        """Record the digest of a file qtool has just written and hashed (a committed output), as it is now."""
        try:
            st = os.stat(real)
        except OSError:
            return
        if size is None or st.st_size == size:
            self._put(file_key(real, st), digest, st.st_ctime_ns)

    def refresh(self, real: str, digest: str, key: str) -> None:
        """At the end of a run: `digest` was found for `real` under `key` earlier in this run, and the file's
        ctime has moved only by what this run did to it (qtool's own links): record the ctime of now."""
        try:
            st = os.stat(real)
        except OSError:
            return
        if file_key(real, st) == key:
            self._put(key, digest, st.st_ctime_ns)

    def _put(self, key: str, digest: str, ctime: int) -> None:
        with self.lock:
            old = self.entries.pop(key, None)
            self.entries[key] = {"sha256": digest, "ctime": ctime}  # last: the most recently used
            if old != self.entries[key]:
                self.changed[key] = self.entries[key]

    def save(self) -> None:
        """Write what this object put into the file as it is now: other jobs, and other objects of this
        process (a build's steps beside its own fingerprints), save theirs meanwhile, and a whole copy
        loaded earlier would take their entries back out."""
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            # the entries that can never match again, found before the lock: it stats every one
            dead = self._dead() if len(self.entries) > MAX_ENTRIES else set()
            with self.lock, _locked(self.path.with_name(self.path.name + ".lock")) as locked:
                if not locked:
                    return  # held too long by another job: this one's entries wait for its next save
                merged = _load(self.path)
                for key, entry in self.changed.items():
                    merged.pop(key, None)
                    merged[key] = entry  # last: the most recently used
                if len(merged) > MAX_ENTRIES:  # the dead first, then the least recently used
                    merged = {k: v for k, v in merged.items() if k not in dead}
                    merged = dict(list(merged.items())[-MAX_ENTRIES:])
                self.entries = merged
                tmp.write_text(json.dumps(self.entries, indent=0))  # in order of use: the cut relies on it
                os.replace(tmp, self.path)
                self.changed = {}
        except (OSError, ValueError):
            pass  # the cache is an optimisation only

    @contextmanager
    def keeping(self, files: Iterable[str | os.PathLike]) -> Iterator[None]:
        """Around qtool's own links made or removed (an in-place run's scratch links, an old output's
        removal): those move the ctime of each file linked, and the entries valid before are re-recorded
        after, so the next run does not hash those files again. A file changed meanwhile (another key) is
        not re-recorded."""
        valid = []
        for f in files:
            real = os.path.realpath(f)
            try:
                st = os.stat(real)  # one stat for both: a file replaced between two would take the old digest
            except OSError:
                continue
            digest, key = self.lookup(real, st), file_key(real, st)
            if digest is not None:
                valid.append((real, digest, key))
        yield
        for real, digest, key in valid:
            self.refresh(real, digest, key)
        self.save()

    def _dead(self) -> set[str]:
        """The keys whose file is gone or replaced (another inode, size or mtime): they can never match."""
        with self.lock:
            keys = list(self.entries)
        return {k for k in keys if not _current(k)}


def _current(key: str) -> bool:
    try:
        return file_key(key.rsplit("|", 4)[0]) == key
    except (OSError, ValueError):  # gone; or a key no path can have (a NUL in a hand-edited file)
        return False


@contextmanager
def _locked(path: Path, wait: float | None = None) -> Iterator[bool]:
    """The cache file's read-merge-write, one process at a time (a flock on a file of its own); yields
    False when another job held it for `wait` seconds: the cache never holds a job up."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + (LOCK_WAIT if wait is None else wait)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    locked = False
                    break
                time.sleep(0.02)
        yield locked
    finally:
        os.close(fd)
