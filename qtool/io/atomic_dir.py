"""Output directories that appear only when complete: work in `<out>.partial/`, then rename.

A crash leaves `<out>.partial/` behind (with a journal, where the operation keeps one) for `--resume`;
`<out>` itself is never half-written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qtool.errors import WriteError


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def prepare_output(out: str | Path, *, force: bool = False, resume: bool = False) -> Path:
    """Create (or, with resume, reuse) `<out>.partial/` and return it."""
    out = Path(out)
    partial = partial_path(out)
    if out.exists() and not force:
        raise WriteError(
            "output already exists", path=out, hint="choose another -o, or pass --force to replace it"
        )
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    return partial


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_output(partial: Path, out: str | Path) -> None:
    """Rename the finished `<out>.partial/` to `<out>` (replacing an old `<out>` only after success)."""
    out = Path(out)
    fsync_dir(partial)
    old = None
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    try:
        os.rename(partial, out)
    except OSError as e:
        if old is not None:
            os.rename(old, out)
        raise WriteError(f"cannot move the finished output into place ({e.strerror})", path=out) from None
    fsync_dir(out.parent.resolve())
    if old is not None:
        shutil.rmtree(old)
