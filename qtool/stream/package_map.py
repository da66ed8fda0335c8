"""`importlib.metadata.packages_distributions()`, kept on disk between runs.

transformers calls it once, when `transformers.utils.import_utils` is first imported, to map import names
to distributions. It opens every installed distribution's file list (RECORD / top_level.txt): 1.08 s of
a streamed job's start on the lent GPU machine's image (`python -X importtime`, self time of
`import_utils`), on the critical path before the first layer, and the same again in every run.

The cache holds the result under a key of everything it depends on: the interpreter, for each `sys.path`
directory the `*.dist-info` / `*.egg-info` entries in it (an unpacked egg's `EGG-INFO`) with their mtimes
and inodes, and each zip on `sys.path` with its own.
Installing, upgrading or removing a distribution adds, replaces or removes such an entry: the next call
computes the map again. Not the directories' own mtimes, nor the directories that hold no such entry: the
working directory is on `sys.path` for `python -m qtool`, and every output a job makes there, or a run
from another directory, would change the key. One file per key, so environments
(venvs, working directories) that differ do not evict each other. A cache that cannot be read or written
is skipped (the map is computed as before); nothing else in the process changes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

_ORIGINAL = importlib.metadata.packages_distributions
FILE = "packages-distributions"


def _key() -> list:
    """What the map depends on: the interpreter and the distributions' metadata entries on sys.path."""
    entries = []
    for entry in sys.path:
        d = entry or "."
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith((".dist-info", ".egg-info")) or n == "EGG-INFO")
        except OSError:
            try:  # a zip (zipped eggs and wheels hold distributions too): the file itself
                st = os.stat(d)
            except OSError:
                continue  # gone
            entries.append([os.path.abspath(d), st.st_mtime_ns, st.st_ino])
            continue
        found = []
        for name in names:
            try:
                st = os.stat(os.path.join(d, name))
            except OSError:
                continue
            found.append([name, st.st_mtime_ns, st.st_ino])
        # a directory without any (the working directory, for `python -m qtool`) adds nothing to the map;
        # an unpacked `*.egg` on the path is a distribution through its EGG-INFO (found above)
        if found:
            entries.append([os.path.abspath(d), found])
    return [sys.version, sys.prefix, entries]


def packages_distributions() -> dict[str, list[str]]:
    """The standard library's map (import name -> distribution names), from the cache where its key
    matches; a fresh copy each call, as the standard library gives."""
    import hashlib

    from qtool.cache import cache_dir
    from qtool.errors import WriteError
    from qtool.io.jsonio import atomic_write_text

    key = _key()
    path = cache_dir() / f"{FILE}-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return {name: list(dists) for name, dists in data["map"].items()}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass  # none yet, torn or foreign: computed below
    fresh = _ORIGINAL()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "map": fresh}))
        _drop_old_maps(path)
    except (OSError, WriteError):
        pass  # a read-only or full cache dir: the job goes on, paying the scan again next time
    return {name: list(dists) for name, dists in fresh.items()}


KEEP_MAPS = 8  # environments (venvs, or one venv's states before and after an install) served at once


def _drop_old_maps(new: Path) -> None:
    """Every install into an environment keys a new map: keep the KEEP_MAPS most recently written (a day of
    this project's tests left ~300 of them); `new`, just written, is among them."""
    from qtool.io.files import keep_newest

    keep_newest(new.parent, f"{FILE}-*.json", KEEP_MAPS, spare=new)


def install() -> None:
    """Serve this process's `importlib.metadata.packages_distributions()` from the cache."""
    importlib.metadata.packages_distributions = packages_distributions
