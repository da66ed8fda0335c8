"""The persistent sha256 cache of local input files (`$QTOOL_CACHE_DIR/sha256-cache.json`), used by
qtool.io.manifest.InputHasher so that a re-run does not read hundreds of GB again to hash them.

An entry is found by path, device, inode, size and mtime, and is trusted only while the file's ctime is
the one recorded: the kernel moves the ctime on every change of the file and no user tool can put it back
the way `touch -d`, `cp -p` or `rsync -t` put back an mtime, so a same-size edit with the mtime restored is
hashed again. A link made or removed (qtool's own hard links into an output, or `rm -rf` of an old output)
also moves the ctime; it changes the link count but not the content, so an entry whose link count changed
is trusted again when the content sample (qtool.io.identity.content_sample_digest: ~3 MiB read) agrees.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from qtool.io.identity import content_sample_digest


def _key(real: str, st: os.stat_result) -> str:
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
        e = self.entries.get(_key(real, st))
        if e is None or not isinstance(e.get("sha256"), str):
            return None
        if e.get("ctime") == st.st_ctime_ns:
            return e["sha256"]
        if e.get("nlink") != st.st_nlink and e.get("sample") == content_sample_digest(real):
            with self.lock:
                e.update(ctime=st.st_ctime_ns, nlink=st.st_nlink)
                self.dirty = True
            return e["sha256"]
        return None

    def store(self, real: str, digest: str, before: os.stat_result) -> None:
        """Record `digest`, hashed from `real` whose stat was `before` when the read began: only if the file
        did not change meanwhile (a link made meanwhile is fine: same key, another link count)."""
        after = os.stat(real)
        if _key(real, after) != _key(real, before) or (
                after.st_ctime_ns != before.st_ctime_ns and after.st_nlink == before.st_nlink):
            return
        entry = {"sha256": digest, "ctime": after.st_ctime_ns, "nlink": after.st_nlink,
                 "sample": content_sample_digest(real)}
        with self.lock:
            self.entries[_key(real, after)] = entry
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            with self.lock:
                tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass  # the cache is an optimisation only
