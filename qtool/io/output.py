"""The one output transaction every writing command goes through.

Promises (README "Outputs"), kept here once instead of in each op:

- an output directory never overlaps a source: OUT that is, contains or lies inside an input (symlinks
  resolved) is refused before anything is written;
- an existing OUT is replaced only with --force and only when qtool made it (it holds a qtool manifest
  or build-step marker); any other non-empty directory or file is refused whatever the flags, and so is
  a qtool output holding files its manifest does not list (a user's, which the replacement would delete);
  the rule is checked as the run begins and again at its commit (a build replaces its own recipe's
  artifact without --force: qtool.ops.pipeline.run);
- one writer at a time: an exclusive lock (flock) beside OUT (also for a checkpoint changed in place);
  a second run gets an error naming the process that holds it (a build holds it for its whole run);
- qtool removes only directories it marked, the marker last, so a removal a kill interrupted is finished
  by the next run;
- work happens in `OUT.partial/`, moved into place only when complete;
- files are created and placed by qtool.io.files (never written through a link to a source);
- every output file gets the same permission bits (those of the primary source's files, since hard
  links share their inode and mode with the source);
- a resume journal is keyed by the plan AND by the inputs' identity (qtool.io.identity), so an input
  changed since the interrupted run refuses to mix;
- in-place work is the same transaction swapped in atomically (qtool.io.in_place).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from qtool.errors import QtoolError, UsageError, WriteError
from qtool.io.files import (
    INPUT_DIGESTS,
    TMP_SUFFIX,
    LinkMode,
    Placer,
    fsync_path,
    hash_file,
    open_regular,
    read_regular,
    write_error,
)
from qtool.io.identity import JOURNAL_NAME, journaled_files
from qtool.io.jsonio import loads
from qtool.notices import tell

MANIFEST_NAME = "qtool-manifest.json"
STEP_MARKER = "qtool-step.json"  # a build step's finished output (qtool/ops/pipeline)
# qtool's records about an output directory, not part of the checkpoint: an output made from it writes its
# own manifest, and a build writes a step's marker after the step's manifest lists its files (so a marker
# carried over would differ from its listing and fail `verify --deep`)
RECORDS = frozenset({MANIFEST_NAME, STEP_MARKER})
LOCK_NAME = ".qtool-lock"
PARTIAL_MARKER = ".qtool-partial"  # in every OUT.partial/ qtool makes: only such a directory is ever removed
SWAPPED_MARKER = ".qtool-swapped-out"  # in a replaced state qtool parked under its hidden `.NAME.qtool-old`
REMOVING_MARKER = ".qtool-removing"  # in a directory of qtool's whose removal began (remove_ours)


def partial_path(out: Path) -> Path:
    out = Path(os.path.abspath(out))  # `-o .` has no name to extend
    return out.with_name(out.name + ".partial")


def old_path(out: Path) -> Path:
    """Where a replaced OUT (or a checkpoint's previous state) waits to be removed: a hidden name of qtool's
    own, never one a user's backup could have (`OUT.old`)."""
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name}.qtool-old")


def remove_parked(path: Path) -> None:
    """Remove a previous state qtool parked at `path` (it carries SWAPPED_MARKER); a directory of anyone
    else's at that name is refused, never removed."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir() or not (path / SWAPPED_MARKER).exists():
        raise WriteError(
            "a directory at a name qtool uses for replaced outputs was not made by qtool",
            path=path,
            hint="move it away",
        )
    remove_marker_last(path, SWAPPED_MARKER)


def remove_ours(path: Path) -> None:
    """Remove a directory qtool made (its partial marker present, a finished output whose commit was
    killed before its rename, one whose removal a kill interrupted, or empty); anything else is refused.
    The removal marks it first, so a kill midway (the manifest and shards gone, the rest not) leaves a
    directory the next run still knows as qtool's and finishes removing."""
    if not os.path.lexists(path):
        return
    if (
        path.is_symlink()
        or not path.is_dir()
        or (
            any(path.iterdir())
            and not (path / PARTIAL_MARKER).exists()
            and not (path / REMOVING_MARKER).exists()
            and not made_by_qtool(path)
        )
    ):
        raise WriteError(
            "a directory in qtool's way was not made by qtool",
            path=path,
            hint="move it away (qtool uses this name for its unfinished output)",
        )
    (path / REMOVING_MARKER).touch()
    fsync_path(path)
    remove_marker_last(path, REMOVING_MARKER)


def remove_marker_last(path: Path, marker: str) -> None:
    """rmtree a directory of qtool's, the marker that proves it qtool's last: a kill at any point of the
    removal leaves the marker, so the next run (whatever its flags) finishes the removal instead of
    refusing what is left as someone else's directory."""
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name != marker:
            _remove_entry(Path(entry.path))
    fsync_path(path)  # the rest is gone for good before the proof goes
    (path / marker).unlink(missing_ok=True)
    os.rmdir(path)


def _remove_entry(p: Path) -> None:
    """One entry of a directory being removed (a named step: the kill tests stop a removal midway here)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def unmark(partial: Path) -> None:
    """Remove a finished partial's marker (durably) right before its rename, so that a kill right after
    the rename leaves a clean OUT; a kill between the two leaves a finished OUT.partial without it, which
    its manifest proves qtool's (remove_ours)."""
    (partial / PARTIAL_MARKER).unlink(missing_ok=True)
    fsync_path(partial)


# ---- where an output may go ------------------------------------------------------------------------


def check_no_overlap(out: Path, sources: Iterable[Path], *, what: str = "-o") -> None:
    """Refuse an output that is, contains or lies inside a source (symlinks resolved)."""
    out_real = Path(os.path.realpath(out))
    for src in sources:
        r = Path(os.path.realpath(src))
        if out_real == r or r in out_real.parents or out_real in r.parents:
            raise UsageError(
                f"the output directory overlaps an input ({r})",
                path=out,
                hint=f"choose an {what} outside every input directory",
            )


MANIFEST_HEAD = ("qtool_version", "operation", "command", "libraries", "sources", "summary", "checks")


def not_ours_reason(path: Path) -> str | None:
    """None when `path` is a directory qtool published as a NEW output, else why not (for the error).

    Ownership is read, never guessed from a file name: the manifest is parsed and must carry the head
    fields only qtool's executor writes (qtool.io.manifest.write_manifest) with `created_by_qtool: true`,
    and every shard it lists must be there (a user's edit or removal of a side file keeps it qtool's); a
    build step's marker must carry its key and file list the same way. A checkpoint qtool changed in place
    says `created_by_qtool: false` (it stays the user's), and an empty or foreign manifest proves nothing."""
    marker = path / STEP_MARKER
    if os.path.lexists(marker):
        try:
            obj = json.loads(read_regular(marker))
        except (QtoolError, ValueError):
            return f"its {STEP_MARKER} is not a qtool build-step marker"
        files = obj.get("files") if isinstance(obj, dict) else None
        if not isinstance(files, dict) or not isinstance(obj.get("key"), str):
            return f"its {STEP_MARKER} is not a qtool build-step marker"
        missing = [rel for rel in files if not _is_file(path / rel)]
        return f"files its {STEP_MARKER} lists are missing: {', '.join(missing[:3])}" if missing else None
    if not os.path.lexists(path / MANIFEST_NAME):
        return f"no {MANIFEST_NAME}"
    try:
        m = loads(read_regular(path / MANIFEST_NAME))
    except (QtoolError, ValueError):
        return f"its {MANIFEST_NAME} is not a qtool manifest (unreadable or not JSON)"
    if (
        not isinstance(m, dict)
        or any(k not in m for k in MANIFEST_HEAD)
        or not isinstance(m.get("files"), dict)
        or not m["files"]
    ):
        return f"its {MANIFEST_NAME} is not a qtool manifest (the fields qtool writes are missing)"
    if m.get("created_by_qtool") is not True:
        return "qtool changed this checkpoint in place: it stays yours"
    # the shards it lists must be there (all its files for an output of side files only, e.g. `download
    # --include '*.json'`): a manifest copied into someone else's directory does not make it qtool's, and a
    # side file the user deleted or edited (a tokenizer file, config.json) does not make a qtool output theirs
    shards = [rel for rel in m["files"] if rel.endswith(".safetensors")] or list(m["files"])
    missing = [rel for rel in shards if not _is_file(path / rel)]
    if missing:
        return f"files its {MANIFEST_NAME} lists are missing: {', '.join(missing[:3])}"
    return None


def _is_file(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except OSError:
        return False


_HUB_REPO_DIR = re.compile(r"^(models|datasets|spaces)--.+")


def check_not_in_hub_cache(out: Path, what: str = "-o") -> None:
    """An output never lies inside a Hugging Face cache (a `models--ORG--NAME/` repo folder, or the cache
    root huggingface_hub uses): huggingface_hub owns those files (snapshots are links into blobs/, named by
    their hashes), and a directory qtool wrote there would pass for part of a snapshot."""
    real = Path(os.path.realpath(out))
    roots = []
    try:
        from huggingface_hub import constants

        roots.append(Path(os.path.realpath(constants.HF_HUB_CACHE)))
    except ImportError:
        pass
    for d in (real, *real.parents):
        if _HUB_REPO_DIR.match(d.name) or d in roots:
            raise UsageError(
                f"{what} lies inside a Hugging Face cache",
                path=out,
                got=str(d),
                hint=f"choose an {what} outside the cache (qtool reads the cache as it is: pass the "
                "snapshot directory itself as an input)",
            )


def unlisted_files(path: Path) -> list[str]:
    """The files in qtool's output `path` that its manifest (or build-step marker) does not list: someone
    else's (a user's NOTES.txt), which replacing the output would delete with it. qtool's own markers and
    the manifest are not among them."""
    try:
        record = json.loads(
            read_regular(path / (STEP_MARKER if os.path.lexists(path / STEP_MARKER) else MANIFEST_NAME))
        )
        listed = set(record["files"])
    except (QtoolError, ValueError, KeyError, TypeError):
        return []  # not qtool's: check_replaceable refuses it on that ground
    out = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_dir() and not p.is_symlink():
            continue  # a directory holds nothing of its own (its files are listed or named here)
        if rel in listed or rel in (MANIFEST_NAME, STEP_MARKER) or p.name.startswith(".qtool-"):
            continue
        out.append(rel)
    return out


def made_by_qtool(path: Path) -> bool:
    """A directory qtool created (a build step, or a published output): `not_ours_reason` is None."""
    return not_ours_reason(path) is None


def check_replaceable(out: Path, *, force: bool, any_owner: bool = False) -> None:
    """An existing OUT may be replaced only with --force and only when qtool made it (or it is empty).
    `any_owner`: a place only qtool writes (its caches, build steps), where the marker test is skipped."""
    if not os.path.lexists(out):
        return
    if not out.is_dir() or out.is_symlink():
        raise WriteError(
            "the output path exists and is not a directory qtool made",
            path=out,
            hint="choose another -o; qtool never replaces it",
        )
    if not any(out.iterdir()):
        return  # an empty directory (e.g. made by `mkdir` first): nothing to lose
    why = None if any_owner else not_ours_reason(out)
    if why is not None:
        raise WriteError(
            f"the output directory exists and was not made by qtool ({why})",
            path=out,
            hint="choose another -o; qtool replaces only directories it made, even with --force",
        )
    if not force:
        raise WriteError("output already exists", path=out, hint="choose another -o, or pass --force to replace it")
    unlisted = [] if any_owner else unlisted_files(out)
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        raise WriteError(
            f"the output directory holds files its {MANIFEST_NAME} does not list: {shown}",
            path=out,
            hint="move them out of it (replacing the output would delete them), or choose another -o",
        )


def check_file_output(
    out: Path, *, sources: Iterable[Path], force: bool, ours: Callable[[bytes], bool], what: str = "-o"
) -> None:
    """The directory contract's promises for a one-file output (`report -o`, `eval kld --emit-windows`):
    never a path that is or lies inside a source (symlinks resolved); an existing file is replaced only
    with --force and only when `ours(its first 4 KiB)` says qtool wrote it; a FIFO, a directory or a
    symlink at that name is refused without being opened for writing (a FIFO would hang the run)."""
    out = Path(out)
    out_real = Path(os.path.realpath(out))
    for src in sources:
        r = Path(os.path.realpath(src))
        if out_real == r or r in out_real.parents:
            raise UsageError(
                f"{what} lies inside an input ({r})", path=out, hint=f"choose an {what} outside every input"
            )
    check_not_in_hub_cache(out, what)
    if not os.path.lexists(out):
        parent = out_real.parent
        if not parent.is_dir():
            raise WriteError("the output's directory does not exist", path=parent, hint="create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise WriteError(
                "the output's directory is not writable",
                path=parent,
                hint=f"choose another {what}, or fix the directory's permissions",
            )
        return
    st = os.lstat(out)
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a symlink"
            if stat.S_ISLNK(st.st_mode)
            else ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
        )
        raise WriteError(
            f"the output path exists and is {kind}",
            path=out,
            hint=f"choose another {what}; qtool replaces only regular files it wrote",
        )
    with os.fdopen(open_regular(out, "the output file"), "rb") as f:
        head = f.read(4096)
    if not ours(head):
        raise WriteError(
            "the output file exists and was not written by qtool",
            path=out,
            hint=f"choose another {what}; qtool replaces only files it wrote, even with --force",
        )
    if not force:
        raise WriteError(
            "output already exists", path=out, hint=f"choose another {what}, or pass --force to replace it"
        )


# ---- one writer at a time --------------------------------------------------------------------------


class OutputLock:
    """An exclusive, non-blocking flock on a lock file. The file holds the owner's pid (for the error a
    second run gets) and is removed on release; a lock file replaced under us is detected and retried."""

    def __init__(self, path: Path, target: Path) -> None:
        self.path = path
        self.target = target
        self.fd: int | None = None

    def acquire(self) -> OutputLock:
        for _ in range(5):
            try:
                # O_NOFOLLOW: a symlink planted at the lock's name must not lead the pid write elsewhere
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise write_error(
                    "cannot create the output's lock file (a symlink or unwritable there?)", e, self.path
                ) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise WriteError(
                    "the output's lock file is not a regular file",
                    path=self.path,
                    hint="remove it (qtool creates it as a plain file)",
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise WriteError(
                    f"another qtool run (pid {holder}) is writing this output",
                    path=self.target,
                    hint="wait for it to finish, or choose another output directory",
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder released and removed it between our open and flock: try again
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = fd
            return self
        raise WriteError("cannot take the output's lock", path=self.path, hint="try again")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class HeldLock:
    """An output's lock that a caller holds across more than one transaction (a build, for its whole run):
    the transaction given it neither takes nor releases it."""

    def __init__(self, lock: OutputLock) -> None:
        self.lock = lock
        self.path, self.target = lock.path, lock.target

    def acquire(self) -> HeldLock:
        if self.lock.fd is None:
            raise RuntimeError("an output transaction was given a lock its caller does not hold")
        return self

    def release(self) -> None:
        pass  # the caller's, released by the caller


def lock_for(out: Path) -> OutputLock:
    """The lock of an output directory (new, or a checkpoint changed in place): `.NAME.qtool-lock`
    beside it, since OUT, OUT.partial and an in-place checkpoint are all renamed."""
    out = Path(os.path.abspath(out))
    return OutputLock(out.parent / f".{out.name}{LOCK_NAME}", out)


# ---- the directory transaction ---------------------------------------------------------------------


def source_file_mode(root: Path) -> int:
    """The permission bits every output file gets: those of the source's shards (hard-linked shards
    share them), else 0644."""
    for p in sorted(Path(root).glob("*.safetensors")):
        try:
            return os.stat(p).st_mode & 0o777
        except OSError:
            continue
    return 0o644


class OutputDir:
    """A new output directory built in `OUT.partial/` under the output lock, then renamed into place.

    with OutputDir(out, sources=[src], force=f, resume=r) as tx:
        ... write into tx.partial (tx.placer for unchanged files, new_file / writer.write_shard for new) ...
        tx.commit()
    Leaving the block without commit (an error, Ctrl-C) keeps `OUT.partial/` for --resume.
    """

    in_place = False

    def __init__(
        self,
        out: str | Path,
        *,
        sources: Iterable[str | Path] = (),
        force: bool = False,
        resume: bool = False,
        link: LinkMode = LinkMode.AUTO,
        stop: threading.Event | None = None,
        file_mode: int | None = None,
        replace_any: bool = False,
        lock: OutputLock | None = None,
    ) -> None:
        self.out = Path(os.path.abspath(out))
        self.partial = partial_path(self.out)
        self.old = old_path(self.out)
        self.sources = [Path(s) for s in sources]
        self.force, self.resume = force, resume
        self.file_mode = (
            file_mode if file_mode is not None else (source_file_mode(self.sources[0]) if self.sources else 0o644)
        )
        self.placer = Placer(link, stop, self.file_mode)
        self.input_digests = self.partial / INPUT_DIGESTS
        # `lock`: OUT's lock, held by the caller for longer than this transaction (a build's whole run)
        self.lock: OutputLock | HeldLock = lock_for(self.out) if lock is None else HeldLock(lock)
        if lock is not None and lock.target != self.out:
            raise RuntimeError(f"the lock given is {lock.target}'s, not {self.out}'s")
        self.replace_any = replace_any  # qtool's own cache and step directories: nobody else's files
        # whether an interruption leaves work a `--resume` re-run continues (what Ctrl-C lists as kept);
        # not qtool's own caches and step directories: the next run makes them again by itself, whatever
        # its flags, so promising their partial to the user would be a promise qtool does not keep
        self.resumable = not replace_any
        self.committed = False
        self.fresh = False  # whether _prepare made the partial (not a resumed one)

    def check(self) -> None:
        """Everything that can be refused before any work: overlap, an existing OUT, a writable parent."""
        for p in (self.out, self.partial, self.old):
            check_no_overlap(p, self.sources)
        if not self.replace_any:  # (qtool's own cache and step directories are never in a Hub cache)
            check_not_in_hub_cache(self.out)
        if self.resume and self.out.exists() and not self.partial.exists() and not self.force:
            raise WriteError(
                "nothing to resume: the output is already complete",
                path=self.out,
                hint="remove it or pass --force to build it again",
            )
        check_replaceable(self.out, force=self.force, any_owner=self.replace_any)
        parent = Path(os.path.abspath(self.out)).parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent  # missing parents are created (like mkdir -p) under this one
        if not parent.is_dir():
            raise WriteError("the output's parent is not a directory", path=parent, hint="choose another -o")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise WriteError(
                "the output's directory is not writable",
                path=parent,
                hint="choose another -o or fix the directory's permissions",
            )

    def __enter__(self) -> OutputDir:
        self.check()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error("cannot create the output's parent directory", e, self.out.parent) from None
        self.lock.acquire()
        try:
            self._prepare()
        except OSError as e:
            self.lock.release()
            raise write_error(self.PREPARE_FAILED, e, self.partial) from None
        except BaseException:
            self.lock.release()
            raise
        # a new attempt at an output replaces an earlier, interrupted one of this process: the partial is
        # this one's now (listed once)
        OPEN[:] = [tx for tx in OPEN if tx.partial != self.partial]
        OPEN.append(self)
        return self

    PREPARE_FAILED = "cannot create the output directory"

    def _prepare(self) -> None:
        """Under the lock: the partial directory made ready (a resumed one kept)."""
        check_replaceable(self.out, force=self.force, any_owner=self.replace_any)  # again, now no one else writes
        remove_parked(self.old)  # a previous OUT a commit killed midway parked there
        resumable = (self.partial / PARTIAL_MARKER).exists() and not (self.partial / REMOVING_MARKER).exists()
        if os.path.lexists(self.partial) and (not self.resume or not resumable):
            tell_discarded(self.partial, self.out)
            remove_ours(self.partial)  # a user's own OUT.partial is refused, never removed
        self.fresh = not os.path.lexists(self.partial)  # (else a resumed one, the interrupted run's work)
        self.partial.mkdir(parents=True, exist_ok=True)
        (self.partial / PARTIAL_MARKER).touch()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def space_hint(self, short: str, mount: Path, copies: str | None) -> str:
        """The fix a refusal for want of free space names (qtool.io.apply.check_space): `short` bytes more
        on `mount`; `copies`: what copying unchanged input files costs, where they are copied."""
        fix = f"free {short} more on {mount}, or choose an -o on a filesystem with room"
        return f"{fix}; {copies}" if copies else fix

    def withdraw(self) -> None:
        """The run was refused before it did any work (an op whose plan is finished inside the transaction:
        quantize's output plan; the output's free-space check, qtool.io.apply.check_space): its new
        partial is removed (an interrupted run's, which a run without
        --resume discards as it begins, is gone already); a resumed one is kept, with the interrupted run's
        work. Never raises: the refusal is the error to report."""
        if self.fresh:
            try:
                remove_ours(self.partial)
            except (OSError, WriteError):
                return
            forget(self)

    def begin(self) -> OutputDir:
        """`with`-less use: enter now; `commit()` releases the lock (so does the process's exit)."""
        return self.__enter__()

    def set_modes(self) -> None:
        """Give every regular file written (not linked) the output's one file mode."""
        for p in self.partial.rglob("*"):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                if st.st_nlink == 1 and st.st_mode & 0o777 != self.file_mode:
                    os.chmod(p, self.file_mode)

    def sweep(self) -> None:
        """Remove temporary files a killed run left behind (a resumed run would otherwise publish them)."""
        for p in self.partial.rglob("*" + TMP_SUFFIX):
            p.unlink()
        if (self.partial / INPUT_DIGESTS).exists():
            (self.partial / INPUT_DIGESTS).unlink()

    def commit(self) -> None:
        """Rename the finished `OUT.partial/` to OUT (a qtool-made OUT is replaced only now, under the rule
        checked as the run began: what appeared at OUT since is refused as it would have been then, and the
        finished partial stays for a --resume)."""
        self.sweep()
        self.set_modes()
        out = self.out
        check_replaceable(out, force=self.force, any_owner=self.replace_any)
        unmark(self.partial)
        old = None
        try:
            if os.path.lexists(out):
                old = self.old
                remove_parked(old)
                (out / SWAPPED_MARKER).touch()  # out is qtool-made (checked above): mark it as parked
                os.rename(out, old)
            os.rename(self.partial, out)
        except OSError as e:
            if old is not None and not out.exists():
                os.rename(old, out)
                (out / SWAPPED_MARKER).unlink(missing_ok=True)
            raise write_error("cannot move the finished output into place", e, out) from None
        fsync_path(Path(os.path.abspath(out)).parent)
        if old is not None:
            remove_parked(old)
        self.committed = True
        forget(self)
        self.lock.release()


# the transactions of this process begun and neither committed nor removed: what an interruption leaves
# for --resume (each leaves by `forget`, so this never grows over a long process: a build, a test session)
OPEN: list[OutputDir] = []


def forget(tx: OutputDir) -> None:
    """Take `tx` out of OPEN: it was committed, or its partial removed, so it leaves nothing to resume."""
    if tx in OPEN:
        OPEN.remove(tx)


def kept_partials() -> list[Path]:
    """The partial outputs an interruption of this process leaves for a `--resume` re-run (for the CLI's
    message); a cache's partial is not one of them (OutputDir.resumable)."""
    return [tx.partial for tx in OPEN if not tx.committed and tx.resumable and tx.partial.is_dir()]


def tell_discarded(partial: Path, out: Path) -> None:
    """Say so when a run without --resume starts over from an interrupted run's partial output."""
    units = len(journaled_files(partial / JOURNAL_NAME))
    layers = max((_layers_done(j) for j in partial.glob(".*/journal.json")), default=0)  # a layer job's own
    if not units and not layers:
        return  # nothing finished there: nothing a user would miss
    done = f"{units} unit(s)" if units else f"{layers} layer(s)"
    tell(
        f"starting over: {partial} (an interrupted run's, {done} finished) is discarded; "
        f"run with --resume instead to continue it"
    )


def _layers_done(journal: Path) -> int:
    """The layers a layer-streamed job's journal (calibrate-kv's, sensitivity's) says are finished."""
    try:
        return int(json.loads(journal.read_text()).get("next_layer", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def output_files(
    root: Path, known: dict[str, str] | None = None, skip: Iterable[str] = (MANIFEST_NAME,)
) -> dict[str, dict]:
    """rel path -> {sha256, bytes} of every file under `root` (the manifest's `files`); `known` gives
    digests already computed (a linked input's, or one hashed while it was written)."""
    known = known or {}
    skip = set(skip)
    out: dict[str, dict] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel in skip or not p.is_file() or p.name.startswith(".qtool-"):
            continue
        out[rel] = {"sha256": known.get(rel) or hash_file(p), "bytes": p.stat().st_size}
    return out
