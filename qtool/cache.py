"""qtool's cache folder (QTOOL_CACHE_DIR, else ~/.cache/qtool): input digests, downloads, compiled kernels,
token ids; every floor that keeps something between runs keeps it here."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("QTOOL_CACHE_DIR") or Path.home() / ".cache" / "qtool")
