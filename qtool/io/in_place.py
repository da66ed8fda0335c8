"""In-place work on a checkpoint, atomic for indexed and unindexed checkpoints alike: the new state is
built beside it and swapped in with one renameat2(RENAME_EXCHANGE)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qtool.errors import WriteError
from qtool.io.files import LinkMode, Placer, fsync_dir, link_tree, write_error
from qtool.io.output import LOCK_NAME, OutputDir, source_file_mode

RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (renameat2 RENAME_EXCHANGE, Linux >= 3.15); False where the
    kernel, libc or filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), RENAME_EXCHANGE)
    return rc == 0


class InPlaceDir(OutputDir):
    """In-place work on the checkpoint `root`, atomic for indexed and unindexed checkpoints alike: the
    new state is built in `root.partial/` (every file of `root` hard-linked, so unchanged shards cost
    nothing; the op replaces or removes entries there, never writing through a link), then swapped with
    `root` in one renameat2(RENAME_EXCHANGE). Readers see the old checkpoint or the new one, never a mix;
    a kill before the swap leaves `root` untouched."""

    in_place = True

    def __init__(self, root: str | Path, *, resume: bool = False) -> None:
        super().__init__(root, force=True, resume=resume, file_mode=source_file_mode(Path(root)))
    def check(self) -> None:
        if not self.out.is_dir():
            raise WriteError("the checkpoint to change in place is not a directory", path=self.out)
        parent = Path(os.path.abspath(self.out)).parent
        if not os.access(parent, os.W_OK | os.X_OK) or not os.access(self.out, os.W_OK | os.X_OK):
            raise WriteError("the checkpoint (or the directory holding it) is not writable", path=self.out,
                             hint="in-place work builds the new state beside the checkpoint and swaps it in: "
                             "fix the permissions, or write a new checkpoint with -o instead")

    BUILDING = ".qtool-inplace-building"  # in the partial tree while it is being built (not after the swap)

    def __enter__(self) -> "InPlaceDir":
        self.check()
        self.lock.acquire()
        try:
            old = self.out.with_name(self.out.name + ".old")
            if old.exists():  # a swap whose clean-up was interrupted
                shutil.rmtree(old)
            if self.partial.exists() and not (self.partial / self.BUILDING).exists():
                shutil.rmtree(self.partial)  # the previous state, swapped out by a run killed just after
            if self.partial.exists() and not self.resume:
                shutil.rmtree(self.partial)
            self.partial.mkdir(exist_ok=True)
            (self.partial / self.BUILDING).touch()
            self._link_tree()
        except OSError as e:
            self.lock.release()
            raise write_error("cannot prepare the in-place change", e, self.partial) from None
        except BaseException:
            self.lock.release()
            raise
        return self

    @classmethod
    def tidy(cls, root: str | Path) -> None:
        """Remove what a run killed right after its swap left beside `root` (the swapped-out previous
        state), for in-place commands that find nothing to change this time."""
        tx = cls(root)
        stale = tx.partial.exists() and not (tx.partial / cls.BUILDING).exists()
        old = tx.out.with_name(tx.out.name + ".old")
        if stale or old.exists():
            with tx.lock:
                for d in ([tx.partial] if stale else []) + ([old] if old.exists() else []):
                    shutil.rmtree(d, ignore_errors=True)

    def _link_tree(self) -> None:
        link_tree(self.out, self.partial, Placer(LinkMode.HARDLINK), keep_existing=True, skip=(LOCK_NAME,))

    def commit(self) -> None:
        self.sweep()
        (self.partial / self.BUILDING).unlink()
        self.set_modes()
        fsync_dir(self.partial)
        old = self.out.with_name(self.out.name + ".old")
        try:
            if exchange_paths(self.partial, self.out):
                os.rename(self.partial, old)  # now the previous state
            else:  # no atomic swap here: two renames (a crash between them leaves both names)
                os.rename(self.out, old)
                os.rename(self.partial, self.out)
        except OSError as e:
            raise write_error("cannot swap the changed checkpoint into place", e, self.out) from None
        fsync_dir(Path(os.path.abspath(self.out)).parent)
        shutil.rmtree(old, ignore_errors=True)
        self.committed = True
        self.lock.release()
