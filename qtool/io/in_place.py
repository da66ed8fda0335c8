"""In-place work on a checkpoint, atomic for indexed and unindexed checkpoints alike: the new state is
built beside it and swapped in with one renameat2(RENAME_EXCHANGE)."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from qtool.errors import WriteError
from qtool.io.digest_cache import files_in, user_cache
from qtool.io.files import LinkMode, Placer, fsync_path, link_tree, write_error
from qtool.io.identity import JOURNAL_NAME, journaled_files
from qtool.io.output import (
    SWAPPED_MARKER,
    HeldLock,
    OutputDir,
    OutputLock,
    forget,
    remove_marker_last,
    remove_parked,
    source_file_mode,
    tell_discarded,
)

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


def in_place_partial(root: Path) -> Path:
    """Where the new state of a checkpoint changed in place is built: a hidden name of qtool's own beside
    it (never a name a user's own directory could have, such as CKPT.partial)."""
    root = Path(os.path.realpath(root))
    return root.with_name(f".{root.name}.qtool-inplace")


@contextmanager
def _held(lock: OutputLock | HeldLock) -> Iterator[None]:
    """`lock` held within (an OutputLock's `with`, for either kind)."""
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class InPlaceDir(OutputDir):
    """In-place work on the checkpoint `root`, atomic for indexed and unindexed checkpoints alike: the
    new state is built in `.CKPT.qtool-inplace/` beside it (every file of `root` hard-linked, so unchanged
    shards cost nothing; the op replaces or removes entries there, never writing through a link), then
    swapped with `root` in one renameat2(RENAME_EXCHANGE). Readers see the old checkpoint or the new one,
    never a mix; a kill before the swap leaves `root` untouched."""

    in_place = True
    BUILDING = ".qtool-inplace-building"  # in the partial tree while it is being built (not after the swap)

    def __init__(self, root: str | Path, *, resume: bool = False, keep_partial: bool = True) -> None:
        real = Path(os.path.realpath(root))  # a symlinked checkpoint: its target changes, the link stays
        super().__init__(real, force=True, resume=resume, file_mode=source_file_mode(real))
        self.partial = in_place_partial(real)
        self.input_digests = self.partial / ".qtool-input-digests.jsonl"
        self.keep_partial = keep_partial  # False: an op without --resume removes its partial on failure
        self.resumable = keep_partial

    @classmethod
    def recover(cls, root: str | Path) -> None:
        """A run without RENAME_EXCHANGE killed between its two renames left the checkpoint parked under
        qtool's old name and its complete new state in the partial directory: finish the swap (called
        before the checkpoint is opened, so that "not found" never hides the data)."""
        tx = cls(root)
        if (
            not os.path.lexists(tx.out)
            and (tx.old / SWAPPED_MARKER).exists()
            and tx.partial.is_dir()
            and not (tx.partial / cls.BUILDING).exists()
        ):
            with _held(tx.lock):
                os.rename(tx.partial, tx.out)
                remove_parked(tx.old)

    def check(self) -> None:
        if not self.out.is_dir():
            raise WriteError("the checkpoint to change in place is not a directory", path=self.out)
        parent = self.out.parent
        if not os.access(parent, os.W_OK | os.X_OK) or not os.access(self.out, os.W_OK | os.X_OK):
            raise WriteError(
                "the checkpoint (or the directory holding it) is not writable",
                path=self.out,
                hint="in-place work builds the new state beside the checkpoint and swaps it in: "
                "fix the permissions, or write a new checkpoint with -o instead",
            )
        if os.stat(self.out).st_dev != os.stat(parent).st_dev:
            raise WriteError(
                "the checkpoint is a mount point: its new state cannot be built beside it",
                path=self.out,
                hint="write a new checkpoint with -o instead",
            )

    def _clear_stale(self) -> None:
        remove_parked(self.old)  # a swap whose clean-up was interrupted
        marked = (self.out / SWAPPED_MARKER).exists()  # a run killed in its commit, just before the swap
        if (
            marked
            and os.path.isdir(self.partial)
            and not (self.partial / self.BUILDING).exists()
            and not (self.partial / SWAPPED_MARKER).exists()
        ):
            shutil.rmtree(self.partial)  # that run's finished new state, never swapped in: ours, unused
        if marked:
            (self.out / SWAPPED_MARKER).unlink()
        if os.path.lexists(self.partial) and not (self.partial / self.BUILDING).exists():
            remove_parked(self.partial)  # the previous state, swapped out by a run killed just after

    def __exit__(self, *exc: object) -> None:
        if not self.committed and not self.keep_partial and self.partial.exists():
            self._remove_building()
            forget(self)
        self.lock.release()

    PREPARE_FAILED = "cannot prepare the in-place change"

    def space_hint(self, short: str, mount: Path, copies: str | None) -> str:
        """Its unchanged files are links already: only the rewritten ones need room, beside the checkpoint."""
        return (
            f"free {short} more on the checkpoint's filesystem ({mount}): the files this run rewrites are "
            "written beside it; or write the result elsewhere with -o"
        )

    def _prepare(self) -> None:
        self._clear_stale()
        # the links removed and made here move the checkpoint's files' ctimes: their sha256 cache entries
        # are kept, or every in-place run would hash the whole checkpoint again (qtool.io.digest_cache)
        with user_cache().keeping(files_in(self.out)):
            if self.partial.exists() and not self.resume:
                tell_discarded(self.partial, self.out)
                remove_marker_last(self.partial, self.BUILDING)  # (_clear_stale left only one being built)
            self.fresh = not self.partial.exists()  # (else a resumed one, the interrupted run's work)
            self.partial.mkdir(exist_ok=True)
            (self.partial / self.BUILDING).touch()
            self._link_tree()

    def withdraw(self) -> None:
        """OutputDir.withdraw's promise: the new state this run began (links of the checkpoint's files) is
        removed, a resumed one kept; never raises."""
        if self.fresh:
            self._remove_building()
            forget(self)

    def _remove_building(self) -> None:
        """Remove the new state being built, its BUILDING marker last (a kill midway leaves a directory the
        next run still knows as this one's); never raises: it runs on the way out of a failed run."""
        with suppress(OSError):
            remove_marker_last(self.partial, self.BUILDING)

    @classmethod
    def tidy(cls, root: str | Path) -> None:
        """Remove what a run killed right after its swap left beside `root` (the swapped-out previous
        state), for in-place commands that find nothing to change this time."""
        tx = cls(root)
        if os.path.lexists(tx.old) or (tx.partial.exists() and not (tx.partial / cls.BUILDING).exists()):
            with _held(tx.lock):
                tx._clear_stale()

    def _link_tree(self) -> None:
        """The checkpoint's current files, hard-linked. On --resume the work of the run being resumed is
        kept: its work directories (hidden entries the checkpoint itself does not have) and the files its
        journal records as finished; everything else is linked afresh, so a file changed or removed in the
        checkpoint since is not brought back."""
        done = journaled_files(self.partial / JOURNAL_NAME) if self.resume else set()
        for entry in list(self.partial.iterdir()):
            if entry.name.startswith(".") and not os.path.lexists(self.out / entry.name):
                continue
            if entry.name in done and entry.is_file():
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        link_tree(
            self.out,
            self.partial,
            Placer(LinkMode.HARDLINK),
            skip=(SWAPPED_MARKER,),
            relative_links=True,
            keep_existing=True,
        )

    def commit(self) -> None:
        self.sweep()
        self.set_modes()
        st = os.stat(self.out)  # the checkpoint directory keeps its own mode, owner and group
        os.chmod(self.partial, stat.S_IMODE(st.st_mode))
        # not ours to give away (PermissionError): the directory stays the caller's, like the files it writes
        with suppress(PermissionError):
            os.chown(self.partial, st.st_uid, st.st_gid)
        fsync_path(self.partial)
        # the state about to be parked is marked first, and only then is the new one unmarked: a kill at any
        # point leaves markers that say which directory is which (_clear_stale)
        (self.out / SWAPPED_MARKER).touch()
        (self.partial / self.BUILDING).unlink()
        try:
            if exchange_paths(self.partial, self.out):
                os.rename(self.partial, self.old)  # now the previous state
            else:  # no atomic swap here: two renames (a kill between them is finished by recover())
                os.rename(self.out, self.old)
                os.rename(self.partial, self.out)
        except OSError as e:
            if self.out.is_dir() and self.partial.is_dir() and not (self.partial / SWAPPED_MARKER).exists():
                (self.out / SWAPPED_MARKER).unlink(missing_ok=True)  # nothing moved: as before the commit
                (self.partial / self.BUILDING).touch()
            raise write_error("cannot swap the changed checkpoint into place", e, self.out) from None
        fsync_path(self.out.parent)
        with suppress(OSError, WriteError):
            remove_parked(self.old)  # its SWAPPED_MARKER last: a kill midway is finished by the next run
        self.committed = True
        forget(self)
        self.lock.release()
