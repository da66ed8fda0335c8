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

import json
import os
import threading
from pathlib import Path


# Entries kept: a 397B's input and outputs are ~200 files, so this is dozens of models' worth. Unbounded,
# the cache grew by every file any run ever hashed (a day of this project's tests: 55k entries, 13 MB, of
# which 97% named files long gone), and every job pays its load and save: 0.14 + 0.42 s on the 2-core VM.
MAX_ENTRIES = 8192


def file_key(real: str, st: os.stat_result | None = None) -> str:
    st = st or os.stat(real)
    return f"{real}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"


class DigestCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError):
            loaded = {}
        # entries of the older string form (keyed without the ctime) prove nothing: dropped
        self.entries: dict[str, dict] = {k: v for k, v in loaded.items() if isinstance(v, dict)} \
            if isinstance(loaded, dict) else {}
        self.lock = threading.Lock()
        self.dirty = False

    def lookup(self, real: str) -> str | None:
        """The cached sha256 of `real` (a resolved path), or None when it must be hashed."""
        st = os.stat(real)
        e = self.entries.get(file_key(real, st))
        if e is not None and isinstance(e.get("sha256"), str) and e.get("ctime") == st.st_ctime_ns:
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
                self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            with self.lock:
                if len(self.entries) > MAX_ENTRIES:
                    self._prune()
                tmp.write_text(json.dumps(self.entries, indent=0))  # in order of use: _prune relies on it
            os.replace(tmp, self.path)
        except OSError:
            pass  # the cache is an optimisation only

    def _prune(self) -> None:
        """Down to MAX_ENTRIES (holding the lock): first the entries that can never match again (the file is
        gone, or replaced: another inode, size or mtime), then the least recently used."""
        def current(key: str) -> bool:
            try:
                return file_key(key.rsplit("|", 4)[0]) == key
            except OSError:
                return False

        live = {k: v for k, v in self.entries.items() if current(k)}
        self.entries = dict(list(live.items())[-MAX_ENTRIES:])
