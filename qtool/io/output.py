"""The one output transaction every writing command goes through.

Promises (README "Outputs"), kept here once instead of in each op:

- an output directory never overlaps a source: OUT that is, contains or lies inside an input (symlinks
  resolved) is refused before anything is written;
- an existing OUT is replaced only with --force and only when qtool made it (it holds a qtool manifest
  or build-step marker); any other non-empty directory or file is refused whatever the flags;
- one writer at a time: an exclusive lock (flock) next to OUT, or inside the checkpoint for in-place
  work; a second run gets an error naming the process that holds it;
- work happens in `OUT.partial/`, moved into place only when complete;
- a file is never opened for writing if it already exists: it is unlinked first and created with
  O_EXCL, so a hard link to a source (what `place` makes for unchanged shards) can never be written
  through, whatever a resumed or crashed run left behind;
- every output file gets the same permission bits (those of the primary source's files, since hard
  links share their inode and mode with the source);
- a resume journal is keyed by the plan AND by the inputs' identity (`input_identity`: size, mtime and
  a digest of sampled content), so an input changed since the interrupted run refuses to mix.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Iterable, Iterator

from qtool.errors import UsageError, WriteError

MANIFEST_NAME = "qtool-manifest.json"
STEP_MARKER = "qtool-step.json"  # a build step's finished output (qtool/ops/build)
QTOOL_MARKERS = (MANIFEST_NAME, STEP_MARKER)
LOCK_NAME = ".qtool-lock"
FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h


class LinkMode(str, Enum):
    """How an unchanged input file is put into an output (--link)."""

    AUTO = "auto"  # reflink, else hardlink, else copy
    REFLINK = "reflink"
    HARDLINK = "hardlink"
    SYMLINK = "symlink"  # download only: a link into the Hugging Face cache
    COPY = "copy"


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _no_space_hint(e: OSError) -> str | None:
    return "free disk space or choose another output directory" if e.errno == errno.ENOSPC else None


def write_error(what: str, e: OSError, path: str | Path) -> WriteError:
    """A WriteError for an OSError, with the fix for the common causes (full or read-only disk)."""
    hint = _no_space_hint(e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "the directory is not writable: choose another output directory (-o) or fix its permissions"
    return WriteError(f"{what}: {e.strerror}", path=path, hint=hint)


# ---- placing and creating files --------------------------------------------------------------------


def open_new(path: str | Path, mode: int = 0o644) -> int:
    """A descriptor for writing a NEW file at `path`: an existing file (or a link to a source inode) is
    unlinked first, never truncated or written through."""
    if os.path.lexists(path):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


@contextmanager
def new_file(path: str | Path, mode: int = 0o644) -> Iterator:
    """`open_new` as a binary file object; fsynced on success, removed on failure."""
    fd = open_new(path, mode)
    f = os.fdopen(fd, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
    except BaseException:
        f.close()
        if os.path.lexists(path):
            os.unlink(path)
        raise
    f.close()


def _reflink(src: str, dst: str, mode: int, stop) -> bool:
    try:
        with open(src, "rb") as s, new_file(dst, mode) as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return True
    except OSError:
        return False


def _hardlink(src: str, dst: str, mode: int, stop) -> bool:
    try:
        if os.path.lexists(dst):
            os.unlink(dst)
        os.link(os.path.realpath(src), dst)
        return True
    except OSError:
        return False


def _symlink(src: str, dst: str, mode: int, stop) -> bool:
    try:
        if os.path.lexists(dst):
            os.unlink(dst)
        os.symlink(os.path.realpath(src), dst)
        return True
    except OSError:
        return False


TMP_SUFFIX = ".qtool-tmp"  # every temporary file qtool makes ends so; a commit sweeps leftovers
INPUT_DIGESTS = ".qtool-input-digests.jsonl"  # qtool.ops.manifest.InputHasher's record, in OUT.partial/


def copy_file(src: str | Path, dst: str | Path, mode: int = 0o644) -> None:
    """Copy `src` to a NEW file `dst` (kernel-side, fsynced): side files and small inputs."""
    _copy(str(src), str(dst), mode, None)


def _copy(src: str, dst: str, mode: int, stop) -> bool:
    from qtool.io.writer import copy_range

    try:
        with open(src, "rb") as s, new_file(dst, mode) as d:
            copy_range(s.fileno(), d.fileno(), 0, os.fstat(s.fileno()).st_size, stop)
    except OSError as e:
        raise write_error("copying a file failed", e, dst) from None
    return True


_ORDER = {
    LinkMode.AUTO: ("reflink", "hardlink", "copy"),
    LinkMode.REFLINK: ("reflink",),
    LinkMode.HARDLINK: ("hardlink",),
    LinkMode.SYMLINK: ("symlink",),
    LinkMode.COPY: ("copy",),
}
_METHODS = {"reflink": _reflink, "hardlink": _hardlink, "symlink": _symlink, "copy": _copy}


class Placer:
    """Puts unchanged input files into an output: the only link/copy helper. `auto` remembers what
    failed, so a 100-shard job probes each method once (several writer threads share one Placer)."""

    def __init__(self, mode: LinkMode = LinkMode.AUTO, stop: threading.Event | None = None,
                 file_mode: int = 0o644) -> None:
        self.mode = LinkMode(mode)
        self.stop = stop  # copies end early (writer.Interrupted) once set
        self.file_mode = file_mode
        self.failed: set[str] = set()

    def place(self, src: str | Path, dst: str | Path) -> str:
        """Put `src` at `dst` (durable on return); returns the method used."""
        src, dst = str(src), str(dst)
        for method in _ORDER[self.mode]:
            if method in self.failed:
                continue
            if _METHODS[method](src, dst, self.file_mode, self.stop):
                return method
            self.failed.add(method)
        raise WriteError(
            f"--link {self.mode.value} is not possible here",
            path=dst,
            hint="the output must be on the same filesystem as the source for hardlinks, and on btrfs/xfs "
            "for reflinks; use --link auto or --link copy",
        )

    def expect_new_bytes(self, src: str | Path, out_dir: str | Path) -> bool:
        """Whether placing `src` will (probably) consume new disk space."""
        if self.mode is LinkMode.COPY:
            return True
        if self.mode is LinkMode.SYMLINK:
            return False
        try:
            same_fs = os.stat(os.path.realpath(src)).st_dev == os.stat(out_dir).st_dev
        except OSError:
            return True
        return not same_fs


# ---- where an output may go ------------------------------------------------------------------------


def check_no_overlap(out: Path, sources: Iterable[Path], *, what: str = "-o") -> None:
    """Refuse an output that is, contains or lies inside a source (symlinks resolved)."""
    out_real = Path(os.path.realpath(out))
    for src in sources:
        r = Path(os.path.realpath(src))
        if out_real == r or r in out_real.parents or out_real in r.parents:
            raise UsageError(f"the output directory overlaps an input ({r})", path=out,
                             hint=f"choose an {what} outside every input directory")


def made_by_qtool(path: Path) -> bool:
    return any((path / m).is_file() for m in QTOOL_MARKERS)


def check_replaceable(out: Path, *, force: bool, any_owner: bool = False) -> None:
    """An existing OUT may be replaced only with --force and only when qtool made it (or it is empty).
    `any_owner`: a place only qtool writes (its caches, build steps), where the marker test is skipped."""
    if not os.path.lexists(out):
        return
    if not out.is_dir() or out.is_symlink():
        raise WriteError("the output path exists and is not a directory qtool made", path=out,
                         hint="choose another -o; qtool never replaces it")
    if not any(out.iterdir()):
        return  # an empty directory (e.g. made by `mkdir` first): nothing to lose
    if not any_owner and not made_by_qtool(out):
        raise WriteError(f"the output directory exists and was not made by qtool (no {MANIFEST_NAME})",
                         path=out, hint="choose another -o; qtool replaces only directories it made, "
                         "even with --force")
    if not force:
        raise WriteError("output already exists", path=out,
                         hint="choose another -o, or pass --force to replace it")


# ---- one writer at a time --------------------------------------------------------------------------


class OutputLock:
    """An exclusive, non-blocking flock on a lock file. The file holds the owner's pid (for the error a
    second run gets) and is removed on release; a lock file replaced under us is detected and retried."""

    def __init__(self, path: Path, target: Path) -> None:
        self.path = path
        self.target = target
        self.fd: int | None = None

    def acquire(self) -> "OutputLock":
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise write_error("cannot create the output's lock file", e, self.path) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise WriteError(f"another qtool run (pid {holder}) is writing this output", path=self.target,
                                 hint="wait for it to finish, or choose another output directory") from None
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
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_for(out: Path) -> OutputLock:
    """The lock of an output directory (new, or a checkpoint changed in place): `.NAME.qtool-lock`
    beside it, since OUT, OUT.partial and an in-place checkpoint are all renamed."""
    out = Path(os.path.abspath(out))
    return OutputLock(out.parent / f".{out.name}{LOCK_NAME}", out)


# ---- inputs' identity (resume keys) ----------------------------------------------------------------

SAMPLE_HEAD = 1 << 20  # the safetensors header and the first tensors
SAMPLE_BLOCK = 64 << 10
SAMPLE_BLOCKS = 32


def content_sample_digest(path: str | Path) -> str:
    """sha256 of the file's first MiB, its last 64 KiB and 32 evenly spaced 64 KiB blocks: ~3 MiB read
    per file whatever its size, so that a same-size edit with the mtime put back is caught at resume
    time without re-reading hundreds of GB (the manifest's full sha256 is computed in the background)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(os.pread(f.fileno(), SAMPLE_HEAD, 0))
        if size > SAMPLE_HEAD:
            step = max(SAMPLE_BLOCK, (size - SAMPLE_HEAD) // SAMPLE_BLOCKS)
            for off in range(SAMPLE_HEAD, size, step):
                h.update(os.pread(f.fileno(), SAMPLE_BLOCK, off))
            h.update(os.pread(f.fileno(), SAMPLE_BLOCK, max(0, size - SAMPLE_BLOCK)))
    return h.hexdigest()


def input_identity(files: Iterable[str | Path]) -> dict[str, list]:
    """path -> [size, mtime_ns, content sample digest] for each input file."""
    out: dict[str, list] = {}
    for f in sorted({str(f) for f in files}):
        st = os.stat(f)
        out[f] = [st.st_size, st.st_mtime_ns, content_sample_digest(f)]
    return out


def changed_inputs(recorded: dict, now: dict) -> list[str]:
    return sorted(f for f in set(recorded) | set(now) if recorded.get(f) != now.get(f))


def refuse_changed_inputs(recorded: dict, now: dict, partial: Path) -> None:
    changed = changed_inputs(recorded, now)
    if changed:
        raise WriteError(
            f"cannot resume: {len(changed)} input file(s) changed since the interrupted run",
            path=changed[0], got=", ".join(changed[:3]),
            hint=f"run again without --resume to start over (the unfinished output {partial} would mix old "
            "and new inputs)")


class Journal:
    """`OUT.partial/.qtool-journal.jsonl`: a head line (the plan hash and the inputs' identity), then one
    line per finished unit (shard, layer), appended only after that unit is durable."""

    def __init__(self, path: Path, plan_hash: str, inputs: dict[str, list], resume: bool) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        if resume and path.exists():
            lines = path.read_text().splitlines()
            try:
                head = json.loads(lines[0]) if lines else {}
            except ValueError:
                head = {}
            if head.get("plan_hash") != plan_hash:
                raise WriteError(
                    "cannot resume: the unfinished output was started with a different plan",
                    path=path.parent, expected=f"plan {plan_hash[:16]}", got=f"plan {str(head.get('plan_hash'))[:16]}",
                    hint="run the same command as before (same sources, options and inputs), or drop "
                    "--resume to start over")
            refuse_changed_inputs(head.get("inputs") or {}, inputs, path.parent)
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break  # a torn last line: that unit is redone
                self.done[rec["unit"]] = rec
        else:
            self._write_line({"plan_hash": plan_hash, "inputs": inputs}, mode="w")

    def _write_line(self, obj: dict, mode: str = "a") -> None:
        # No fsync: a unit is recorded only after its own fsync, so a line that reaches the disk always
        # describes a durable unit, and a line lost in a crash only means the unit is redone.
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    def record(self, unit: str, **info) -> None:
        rec = {"unit": unit, **info}
        self._write_line(rec)
        self.done[unit] = rec

    def file_done(self, partial: Path, name: str) -> bool:
        """A finished file unit whose file is still there with the recorded size."""
        rec = self.done.get(name)
        p = partial / name
        return rec is not None and p.exists() and p.stat().st_size == rec.get("size")


# ---- the directory transaction ---------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    def __init__(self, out: str | Path, *, sources: Iterable[str | Path] = (), force: bool = False,
                 resume: bool = False, link: LinkMode = LinkMode.AUTO, stop: threading.Event | None = None,
                 file_mode: int | None = None, replace_any: bool = False) -> None:
        self.out = Path(out)
        self.partial = partial_path(self.out)
        self.sources = [Path(s) for s in sources]
        self.force, self.resume = force, resume
        self.file_mode = file_mode if file_mode is not None else (
            source_file_mode(self.sources[0]) if self.sources else 0o644)
        self.placer = Placer(link, stop, self.file_mode)
        self.input_digests = self.partial / INPUT_DIGESTS
        self.lock = lock_for(self.out)
        self.replace_any = replace_any  # qtool's own cache and step directories: nobody else's files
        self.committed = False

    def check(self) -> None:
        """Everything that can be refused before any work: overlap, an existing OUT, a writable parent."""
        check_no_overlap(self.out, self.sources)
        check_no_overlap(self.partial, self.sources)
        if self.resume and self.out.exists() and not self.partial.exists() and not self.force:
            raise WriteError("nothing to resume: the output is already complete", path=self.out,
                             hint="remove it or pass --force to build it again")
        check_replaceable(self.out, force=self.force, any_owner=self.replace_any)
        parent = Path(os.path.abspath(self.out)).parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent  # missing parents are created (like mkdir -p) under this one
        if not parent.is_dir():
            raise WriteError("the output's parent is not a directory", path=parent, hint="choose another -o")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise WriteError("the output's directory is not writable", path=parent,
                             hint="choose another -o or fix the directory's permissions")

    def __enter__(self) -> "OutputDir":
        self.check()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error("cannot create the output's parent directory", e, self.out.parent) from None
        self.lock.acquire()
        try:
            # again, now that no one else writes
            check_replaceable(self.out, force=self.force, any_owner=self.replace_any)
            if self.partial.exists() and not self.resume:
                shutil.rmtree(self.partial)
            self.partial.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.lock.release()
            raise write_error("cannot create the output directory", e, self.partial) from None
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def begin(self) -> "OutputDir":
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
        """Rename the finished `OUT.partial/` to OUT (a qtool-made OUT is replaced only now)."""
        self.sweep()
        self.set_modes()
        fsync_dir(self.partial)
        out = self.out
        old = None
        try:
            if os.path.lexists(out):
                check_replaceable(out, force=True, any_owner=self.replace_any)
                old = out.with_name(out.name + ".old")
                if old.exists():
                    shutil.rmtree(old)
                os.rename(out, old)
            os.rename(self.partial, out)
        except OSError as e:
            if old is not None and not out.exists():
                os.rename(old, out)
            raise write_error("cannot move the finished output into place", e, out) from None
        fsync_dir(Path(os.path.abspath(out)).parent)
        if old is not None:
            shutil.rmtree(old)
        self.committed = True
        self.lock.release()


def hash_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def output_files(root: Path, known: dict[str, str] | None = None, skip: Iterable[str] = (MANIFEST_NAME,)
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


def link_tree(src: Path, dst: Path, placer: Placer, *, keep_existing: bool = False,
              skip: Iterable[str] = ()) -> None:
    """Place every file under `src` at the same relative path under `dst` (symlinks copied as links;
    with `keep_existing`, files already at `dst` are kept: a resumed run's work). `skip`: names left out."""
    skip = set(skip)
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            if f in skip:
                continue
            target = dst / rel / f
            if keep_existing and os.path.lexists(target):
                continue
            s = os.path.join(dirpath, f)
            if os.path.islink(s):
                if os.path.lexists(target):
                    os.unlink(target)
                os.symlink(os.readlink(s), target)
            else:
                placer.place(s, target)


# ---- in-place work: the same transaction, swapped in atomically ---------------------------------------

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
