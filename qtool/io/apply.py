"""The one executor of output plans (qtool.io.plan.OutputPlan), inside an output transaction
(qtool.io.output.OutputDir for a new OUT, qtool.io.in_place.InPlaceDir for in-place work).

    with OutputDir(out, sources=[...], force=..., resume=...) as tx:
        applied = write_output(plan, tx, OutputJob(command=..., values=..., produce=...))

It checks the free space (counting what a resumed `.partial` already holds), keeps the journal (the plan
hash and the inputs' identity, then one line per finished shard, written only after the shard's fsync),
lets the op's producer write its computed shards, writes the shards with WRITERS threads while this thread
writes the side files and the index, checks that every written shard is what the plan promised, writes
the manifest (sources' and outputs' sha256) and commits.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from qtool.errors import VerificationError, WriteError
from qtool.io.digest_cache import user_cache
from qtool.io.files import LinkMode, fsync_path, hash_file, mount_point, new_file
from qtool.io.identity import JOURNAL_NAME, Journal, input_identity
from qtool.io.manifest import InputHasher, carried_files, previous_head, read_manifest, source_entry, write_manifest
from qtool.io.output import MANIFEST_NAME, OutputDir, made_by_qtool, output_files
from qtool.io.plan import (
    Copy,
    Index,
    Json,
    Link,
    OutputPlan,
    Pending,
    Produced,
    Remove,
    Shard,
    Text,
    fed_in,
    index_map,
    index_text_of,
    resolve,
    tensors_of,
)
from qtool.io.safetensors_header import read_header
from qtool.io.writer import FileRange, build_header, write_shard
from qtool.notices import tell

# What a run writes beyond the files its plan lists, estimated from the plan (the free-space check asks for
# it on top): the manifest (qtool.io.manifest.write_manifest) holds a line per output and input file
# (name, sha256, size) and its fixed head (command, libraries, summary, checks); assemble's also every
# tensor's origin, streamed to a section file that is then copied into the manifest (both exist at once);
# the journal a line per shard; each new file wastes the tail of its last filesystem block. A link adds a
# directory entry only, so an output of links (patch-config -o, calibrate-kv -o on the input's filesystem)
# asks for little more than its rewritten files (measured on the tiny fixtures: ~140 bytes per `files`
# line, ~225 per tensor origin).
MANIFEST_HEAD = 64 << 10
BYTES_PER_FILE_RECORD = 512  # its manifest line, journal line and directory entry, rounded up
BYTES_PER_TENSOR_ORIGIN = 2 * 256  # its line in the shards section and in the manifest, rounded up
BLOCK = 4096  # the usual filesystem block: a new file's last one is partly empty
# Shards in flight. Several: a shard's fsync (a synchronous write-out of ~all its bytes) overlaps other
# shards' reads and copies and the disk sees a deeper queue (3 GB assemble job, medians of 5 interleaved
# runs: 1 writer 4.89 s, 2: 3.83 s, 3: 3.29 s, 4: 3.11 s, 6: 3.52 s, 8: 3.66 s).
WRITERS = 4


def free_space(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (a function so tests can monkeypatch it)."""
    return shutil.disk_usage(path).free


@dataclass
class Applied:
    """What the executor did: how each shard got there, and the checks' result."""

    plan_hash: str
    written: list[str] = field(default_factory=list)
    linked: dict[str, int] = field(default_factory=dict)  # link method -> shards
    resumed: list[str] = field(default_factory=list)
    checks: dict = field(default_factory=dict)


class _Countdown:
    """Set once `n` shards have their header on disk (their data may still be being written)."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.lock = threading.Lock()
        self.done = threading.Event()
        if n == 0:
            self.done.set()

    def one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()


def check_space(plan: OutputPlan, tx: OutputDir, journal: Journal, *, tensor_origins: bool = False) -> None:
    """Refuse a run whose output does not fit the free space, before any work: the partial output this run
    made is withdrawn (nothing is left behind for every command at once), a resumed one kept. An unchanged
    input file counts 0 bytes where it will be linked (the link mode allows it and the output is on its
    filesystem); `tensor_origins`: the manifest records every tensor's origin (assemble)."""
    need = copied = new_files = 0
    for e in plan.files:
        if isinstance(e, Remove) or journal.file_done(tx.partial, e.name):
            continue
        if isinstance(e, Link):
            if not tx.placer.expect_new_bytes(e.source, tx.partial):
                continue
            copied += plan.file_size(e)
        new_files += 1
        need += plan.file_size(e)
    margin = space_margin(plan, new_files, tensor_origins)
    have = free_space(tx.partial)
    if have < need + margin:
        tx.withdraw()
        mount = mount_point(tx.partial)
        raise WriteError(
            "not enough free disk space for the output",
            path=tx.out,
            expected=f"{_bytes(need + margin)} free ({_bytes(need)} of files, {_bytes(margin)} for the manifest "
            "and the filesystem's overhead)",
            got=f"{_bytes(have)} free on {mount}",
            hint=tx.space_hint(_bytes(need + margin - have), mount, _copies_hint(plan, tx, copied)),
        )


def space_margin(plan: OutputPlan, new_files: int, tensor_origins: bool) -> int:
    """Bytes a run writes beyond its planned files (see MANIFEST_HEAD)."""
    records = len(plan.files) + len(plan.inputs)
    tensors = sum(len(index_map(e)) for e in plan.entries(Index)) if tensor_origins else 0
    return MANIFEST_HEAD + BYTES_PER_FILE_RECORD * records + BYTES_PER_TENSOR_ORIGIN * tensors + BLOCK * new_files


def _copies_hint(plan: OutputPlan, tx: OutputDir, copied: int) -> str | None:
    """What the refusal adds when unchanged input files are copied rather than linked (None when none is)."""
    if not copied:
        return None
    if tx.placer.mode is LinkMode.COPY:
        return (
            f"--link copy copies the {_bytes(copied)} of unchanged input files: without it they are linked "
            "where the output is on the input's filesystem, taking no space"
        )
    linked_from = sorted(
        {
            str(mount_point(Path(e.source)))
            for e in plan.entries(Link)
            if tx.placer.expect_new_bytes(e.source, tx.partial)
        }
    )
    return (
        f"{_bytes(copied)} of the files are copies of unchanged input files: an -o on the input's "
        f"filesystem ({', '.join(linked_from)}) links them instead, taking no space"
    )


def _bytes(n: int) -> str:
    """A byte count as the refusal shows it: exact, and in GiB, MiB or KiB to read."""
    unit, scale = next((u, 2**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if n >= 2**e or u == "KiB")
    return f"{n} bytes ({n / scale:.1f} {unit})"


def _place(
    e: Link | Shard,
    tx: OutputDir,
    values: dict,
    headers: _Countdown,
    stop: threading.Event,
    given: dict[str, memoryview] | None = None,
) -> tuple[str | None, Future | None]:
    """Write or link one shard and make it durable; returns (the link method, None) when linked,
    (None, its sha256 as a Future: hashed as it was written) when written. `given`: the bytes the
    producer read of a fed shard's sources (tensor name -> buffer)."""
    dst = tx.partial / e.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(e, Link):
        method = tx.placer.place(e.source, dst, on_header=headers.one)  # durable on return
        return method, None
    digest: list = []
    tensors = resolve(tensors_of(e), values)
    got = write_shard(
        dst,
        fed_in(tensors, given) if given else tensors,
        e.metadata,
        on_header=headers.one,
        stop=stop,
        mode=tx.file_mode,
        on_digest=digest.append,
    )  # fsynced
    if e.size is not None and got != e.size:
        digest[0].cancel()
        raise WriteError(
            "a written shard does not have its planned size (a qtool bug)",
            path=dst,
            expected=f"{e.size} bytes",
            got=f"{got} bytes",
        )
    return None, digest[0]


def _write_small(e: Copy | Json | Text | Index, tx: OutputDir, plan: OutputPlan) -> None:
    """A side file: never written through an existing link (io.files.new_file)."""
    dst = tx.partial / e.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(e, Copy):
        tx.placer.copy(e.source, dst)  # (the job's input file: qtool.io.input_files)
        return
    if isinstance(e, Index):
        with new_file(dst, tx.file_mode) as f:
            for chunk in index_text_of(e):
                f.write(chunk.encode())
        return
    data = plan.json_bytes(e) if isinstance(e, Json) else e.text.encode()
    with new_file(dst, tx.file_mode) as f:
        f.write(data)


def check_written(plan: OutputPlan, partial: Path, kinds: tuple = (Produced,)) -> None:
    """Every shard of `kinds` (Produced: write_output checks those; a job whose checks use the plan's view
    of its output asks for Shard too) holds exactly the tensors (names, dtypes, shapes, order) its entry
    promised."""
    for e in plan.entries(*kinds):
        path = partial / e.name
        if not path.exists():
            raise VerificationError("a shard the plan promised was not written (a qtool bug)", path=path)
        # the producers (quantize's layers, a range-fetched Hub shard) write the header the plan promised,
        # byte for byte: compared as bytes, with the file's size (the 397B's 60 layer shards, 372k
        # tensors: 1.9 s parsed and compared tensor by tensor on the 2-core VM, 0.3 s this way); anything
        # else is parsed, which checks the size too, and compared tensor by tensor to name what differs
        planned = build_header(tensors_of(e), e.metadata)
        with open(path, "rb") as f:
            if f.read(len(planned)) == planned and os.fstat(f.fileno()).st_size == plan.file_size(e):
                continue
        got = [(n, i.dtype, tuple(i.shape)) for n, i in read_header(path).tensors.items()]
        want = [(t.name, t.dtype, tuple(t.shape)) for t in e.tensors]
        if got != want:
            # the first difference within the common prefix (strict=False: the lists may differ in length)
            i = next((i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g), min(len(want), len(got)))
            raise VerificationError(
                "a written shard is not what the plan promised (a qtool bug)",
                path=path,
                expected=str(want[i]) if i < len(want) else "no more tensors",
                got=str(got[i]) if i < len(got) else "no more tensors",
            )


class ProducedShards:
    """The executor's side a producer talks to: it says when each Produced shard is complete (`finished`:
    hashed then, while its bytes are in the page cache), hands over the bytes it read of a fed Shard's
    sources (`feed`: the shard is written from them) and asks, at each step of its own, whether a shard
    written beside it failed (`stop_if_failed`: that error is raised, so the producer stops there)."""

    def __init__(
        self,
        partial: Path,
        hasher: InputHasher,
        beside: _EarlyShards | None,
        fed: Iterable[str] = (),
        fed_writer: Callable[[str, Callable[[], dict[str, memoryview]]], _EarlyShards] | None = None,
    ) -> None:
        self.partial = partial
        self._hasher = hasher
        # the threads writing beside the producer: the early shards', then each fed shard's
        self.writers: list[_EarlyShards] = [beside] if beside is not None else []
        self.unfed = set(fed)  # the plan's fed shards not fed yet: copied from the input after produce()
        self._fed_writer = fed_writer

    def stop_if_failed(self) -> None:
        """Raise the error of a shard written beside the producer (early or fed), if one failed."""
        for w in self.writers:
            if w.error is not None:
                raise w.error

    def feed(self, name: str, given: Callable[[], dict[str, memoryview]]) -> None:
        """The producer has read the sources of fed Shard `name`: `given()` -> tensor name -> those bytes
        (called on the writer's thread). The shard is written from them on a thread of its own, now; its
        tensors not given are copied from the input."""
        self.stop_if_failed()
        if name not in self.unfed or self._fed_writer is None:
            raise ValueError(f"{name}: not a fed shard of the plan, or fed twice (a qtool bug)")
        self.unfed.discard(name)
        writer = self._fed_writer(name, given)
        self.writers.append(writer)
        writer.start()

    def join(self) -> None:
        """Wait for every thread writing beside the producer."""
        for w in self.writers:
            w.join()

    def finished(self, name: str, sha256: Future | str | None = None) -> None:
        """Shard `name` (under the partial output) is complete and durable; `sha256`: its digest, or a
        Future of it, where the producer hashed it as it wrote it (else it is read back to be hashed)."""
        try:
            self.stop_if_failed()
        except BaseException:
            if isinstance(sha256, Future):
                sha256.cancel()
            raise
        self._hasher.submit_output(str(self.partial / name), sha256)


class Producer(Protocol):
    """An op's long work inside write_output (calibration, quantized layers: resumable on its own), run
    while the inputs are hashed: it writes the plan's Produced shards into the partial output, tells
    `shards` as each is complete, and may return the bytes of the plan's Pending values."""

    def __call__(self, shards: ProducedShards) -> dict[str, bytes] | None: ...


@dataclass(frozen=True)
class OutputJob:
    """What write_output runs besides the plan itself (all but `command` optional).

    values: the bytes of the plan's Pending sources. produce: the op's Producer. overlap(): more work for
    the executor's thread while the writers copy. on_headers(): called once every shard's header is on
    disk. check() -> {"passed": bool, ...}: run once every file is written, before the manifest: the
    output's checks (recorded in the manifest; a failure keeps the partial output and exits 3). extra():
    more of the manifest's run section. shards_section: the file assemble streams its tensor origins to.
    progress: a bar over the bytes written. early_shards: the Shard entries that need no Pending
    value (quantize's embedding, lm_head, vision tower and MTP head, copied) are written while produce()
    runs, not after its last layer. A `fed` Shard's sources are bytes produce() reads itself (calibrate-kv's
    layers, in the shards it rewrites): it hands them over (ProducedShards.feed) and the shard is written
    from them then, not copied from the input again; its tensors not given, and a fed shard never fed (a
    resumed job's layers before its restart), are copied from the input. stop: set to stop the writers. hasher: the
    transaction's `input_hasher`, where the job began reading before its plan was made (it hashes the files read then;
    its maker closes it, after the reads have ended)."""

    command: str | None
    values: dict[str, bytes] = field(default_factory=dict)
    produce: Producer | None = None
    overlap: Callable[[], None] | None = None
    on_headers: Callable[[], None] | None = None
    check: Callable[[], dict] | None = None
    extra: Callable[[], dict] | None = None
    shards_section: Path | None = None
    progress: bool = False
    early_shards: bool = False
    stop: threading.Event | None = None
    hasher: InputHasher | None = None


def write_output(plan: OutputPlan, tx: OutputDir, job: OutputJob) -> Applied:
    """Run `plan` with `job` in the open transaction `tx` and commit it."""
    values = dict(job.values)
    stop = job.stop or threading.Event()
    produce, hasher, shards_section = job.produce, job.hasher, job.shards_section
    partial = tx.partial
    plan_hash = plan.plan_hash()
    resuming = tx.resume and (partial / JOURNAL_NAME).exists()
    journal = Journal(partial / JOURNAL_NAME, plan_hash, input_identity(plan.inputs), tx.resume)
    check_space(plan, tx, journal, tensor_origins=shards_section is not None)
    own_hasher = hasher is None
    hasher = hasher or input_hasher(tx)
    with _inputs_kept(tx, hasher, own_hasher):
        applied = Applied(plan_hash)
        try:
            if resuming and journal.done:
                # units are journaled only once their inputs are on record (InputHasher.on_record): a partial
                # output without any holds nothing that rests on an input the interrupted run had not hashed.
                # Before the other inputs are submitted: their digests would be recorded as if the interrupted
                # run had made them, and a second --resume would trust them
                hasher.refuse_unproven(plan.inputs, partial)
            for f in plan.inputs:
                hasher.submit(f, plan.taken.get(f))  # (a no-op for those hashed from reads: input_hasher took them)
            for e in plan.entries(Remove):
                if os.path.lexists(partial / e.name):
                    os.unlink(partial / e.name)
            early = _early_shards(plan) if produce is not None and job.early_shards else set()
            writing = _EarlyShards(plan, tx, journal, hasher, applied, stop, early) if early else None
            if writing is not None:
                writing.start()
            fed = {e.name for e in plan.entries(Shard) if e.fed} if produce is not None else set()

            def fed_writer(name: str, given: Callable[[], dict[str, memoryview]]) -> _EarlyShards:
                return _EarlyShards(plan, tx, journal, hasher, applied, stop, {name}, given)

            shards = ProducedShards(partial, hasher, writing, fed, fed_writer)

            try:
                if produce is not None:
                    # the producer says when each Produced file is complete: it is hashed then, while its bytes
                    # are in the page cache and the producer works on the next (not all at the end)
                    values.update(produce(shards) or {})
            except BaseException:
                stop.set()
                raise
            finally:
                shards.join()
            shards.stop_if_failed()
            hasher.finish_streams()
            for e in plan.entries(Produced):
                hasher.submit_output(str(partial / e.name))  # the ones resumed or not announced
            _write_shards(
                plan,
                tx,
                journal,
                hasher,
                values,
                job.overlap,
                job.on_headers,
                applied,
                job.progress,
                stop,
                skip=early | (fed - shards.unfed),  # written beside the producer
            )
            check_written(plan, partial)
            applied.checks = job.check() if job.check is not None else {}
            digests = hasher.results()
        finally:
            if own_hasher:
                hasher.close(keep_files=True)  # (open until the commit's check)
        os.unlink(partial / JOURNAL_NAME)
        files = _manifest(
            plan, tx, digests, job.command, applied.checks, shards_section, job.extra() if job.extra else {}
        )
        if applied.checks and not applied.checks.get("passed", True):
            raise VerificationError(
                f"the output failed its checks; it was left in {partial}",
                path=partial,
                got=applied.checks.get("summary"),
                hint="this is a qtool bug or an inconsistent source; see qtool-manifest.json there",
            )
        fsync_path(partial)
        # the inputs, links of which the output may hold, are the files the job read, unchanged: else it fails
        # naming the file, and nothing is published
        hasher.files.check()
        tx.commit()
        # the commit removed the output it replaced (--force), whose links into the inputs moved their ctime
        # once more: re-recorded, or the next run would hash them all again (qtool.io.digest_cache)
        hasher.refresh(digests)
        _remember_digests(tx.out, files)
        return applied


@contextmanager
def _inputs_kept(tx: OutputDir, hasher: InputHasher, own: bool) -> Iterator[None]:
    """While the job runs: its links and copies of inputs are of the files it opened and checks at commit
    (qtool.io.input_files); those files stay open until then."""
    tx.placer.sources = hasher.files
    try:
        yield
    finally:
        tx.placer.sources = None
        if own:
            hasher.files.close()


def input_hasher(tx: OutputDir, hash_from_reads: Iterable[str] = ()) -> InputHasher:
    """The transaction's input hasher, with the files hashed from the job's reads (`hash_from_reads`:
    qtool.io.stream_digest) submitted: they must be before the job's first read of them. write_output
    submits the other inputs after its resume check. A job that reads before its output plan is made
    (quantize's first layer) makes this first, hands it to write_output and closes it once its reads
    have ended."""
    files = list(hash_from_reads)
    # a resumed run re-hashes its inputs: a cached digest could predate an edit the journal missed
    hasher = InputHasher(trust_cache=not tx.resume, record=tx.input_digests, from_reads=files)
    try:
        for f in files:
            hasher.submit(f)
    except BaseException:
        hasher.close()
        raise
    return hasher


def _remember_digests(root: Path, files: dict) -> None:
    """The sha256 of a committed output's files into qtool's cache (qtool.io.digest_cache), under their
    final paths and ctimes: the next job that reads this output (calibrate-kv of a quantize output, eval
    kld of both) finds them instead of reading its hundreds of GB to hash them."""
    cache = user_cache()
    for rel, entry in files.items():
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            cache.record(os.path.realpath(root / rel), entry["sha256"], entry.get("bytes"))
    cache.save()


def _early_shards(plan: OutputPlan) -> set[str]:
    """The Shard entries written while the producer runs: those that need no Pending value, but not a fed
    one (written once the producer hands over its bytes, ProducedShards.feed)."""
    return {
        e.name
        for e in plan.entries(Shard)
        if not e.fed and not any(isinstance(t.source, Pending) for t in tensors_of(e))
    }


class _EarlyShards(threading.Thread):
    """Writes the `names` shards, journaled as they finish, while the producer runs; an error is kept in
    `error` for write_output (and the producer's ProducedShards.stop_if_failed). `given`: a fed shard's
    bytes, as the producer handed them over (`names` is that shard)."""

    def __init__(
        self,
        plan: OutputPlan,
        tx: OutputDir,
        journal: Journal,
        hasher: InputHasher,
        applied: Applied,
        stop: threading.Event,
        names: set[str],
        given: Callable[[], dict[str, memoryview]] | None = None,
    ) -> None:
        super().__init__(name="qtool-early-shards" if given is None else "qtool-fed-shard")
        self.error: BaseException | None = None
        self._work = (plan, tx, journal, hasher, applied, stop, names)
        self._given = given

    def run(self) -> None:
        plan, tx, journal, hasher, applied, stop, names = self._work
        try:
            got = self._given() if self._given is not None else None
            _write_shards(plan, tx, journal, hasher, {}, None, None, applied, False, stop, names=names, given=got)
        except BaseException as e:  # noqa: BLE001 -- handed to write_output, which raises it
            self.error = e


def _write_shards(
    plan: OutputPlan,
    tx: OutputDir,
    journal: Journal,
    hasher: InputHasher,
    values: dict,
    overlap: Callable[[], None] | None,
    on_headers: Callable[[], None] | None,
    applied: Applied,
    progress: bool,
    stop: threading.Event,
    names: set[str] | None = None,
    skip: frozenset[str] | set[str] = frozenset(),
    given: dict[str, memoryview] | None = None,
) -> None:
    """Write the plan's Link and Shard entries (`names`: only those, and no side files; `skip`: not those,
    written already) and, with every entry, its side files. `given`: a fed shard's bytes (`names` is it)."""
    partial = tx.partial
    todo = []
    mine = [e for e in plan.entries(Link, Shard) if (names is None or e.name in names) and e.name not in skip]
    kept = kept_files(journal, partial, [e.name for e in mine if journal.file_done(partial, e.name)])
    for e in mine:
        if e.name in kept:
            applied.resumed.append(e.name)
            if not isinstance(e, Link):
                hasher.submit_output(str(partial / e.name), kept[e.name])  # hashed just now (or by the pool)
        else:
            todo.append(e)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(plan.file_size(e) for e in todo), unit="B", unit_scale=True, desc=plan.kind, leave=False)
    headers = _Countdown(len(todo))
    told = on_headers is None
    tell_headers = on_headers or (lambda: None)
    unrecorded: list = []  # written, not journaled: the input bytes they hold are not all hashed yet
    # The writers write the shards; this thread journals them in queue order as they finish (only journaled
    # shards count as done, so a crash redoes the ones in flight) and meanwhile writes the side files and
    # the op's overlap work, so all of it overlaps the copy. A written shard is hashed (for the manifest's
    # `files`) as it is written, by a thread trailing its writer through the page cache (write_shard's
    # on_digest); the hasher takes that digest.
    with ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="qtool-shard") as pool:
        # Linked ones first (cheap), then largest first: a big shard started last would finish alone.
        order = sorted(todo, key=lambda e: (not isinstance(e, Link), -plan.file_size(e)))
        futures = [(e, pool.submit(_place, e, tx, values, headers, stop, given)) for e in order]
        try:
            for e in plan.entries(Copy, Json, Text, Index) if names is None else ():
                _write_small(e, tx, plan)
            if overlap is not None:
                overlap()
            for e, fut in futures:
                while not told and not fut.done():
                    if headers.done.wait(0.05):
                        told = True
                        tell_headers()
                method, digest = fut.result()
                if method is None:
                    applied.written.append(e.name)
                    hasher.submit_output(str(partial / e.name), digest)
                else:
                    applied.linked[method] = applied.linked.get(method, 0) + 1
                size = (partial / e.name).stat().st_size
                unrecorded.append((e, size, digest))
                unrecorded = [
                    (w, n, d) for w, n, d in unrecorded if not _journal_if_on_record(w, n, d, journal, hasher)
                ]
                if bar is not None:
                    bar.update(size)
            # the ones written before the pool's input hashes were done: journaled once they are (in the loop
            # nothing waits for them, so that the header-only checks above start while the shards are copied)
            if unrecorded:
                hasher.wait_pooled()
                for w, n, d in unrecorded:
                    _journal_if_on_record(w, n, d, journal, hasher)
        except BaseException:
            stop.set()
            for _, f in futures:
                f.cancel()
            _cancel_digests([f for _, f in futures])
            raise
    if not told:
        tell_headers()
    if bar is not None:
        bar.close()


def _cancel_digests(futures: list[Future]) -> None:
    """A failed write: the shards written meanwhile are thrown away, so are their hashes (qtool.io.writer.
    HashedWrites.stop: none may run on into the interpreter's exit)."""
    from concurrent.futures import wait

    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is None:
            _, digest = f.result()
            if digest is not None:
                digest.cancel()


def _journal_if_on_record(
    e: Link | Shard, size: int, digest: Future | None, journal: Journal, hasher: InputHasher
) -> bool:
    """Journal a written entry once the input bytes it holds are on record (manifest.InputHasher's rule),
    never waiting for them: one left unjournaled is written again by a resumed run (a hard link: nothing;
    a shard from an input's tail, hashed only once the job has read the rest: its copy). A written shard's
    entry carries its sha256 (hashed as it was written, right behind the writer: waited for), which a
    resumed run checks before it keeps the file (kept_files)."""
    if not hasher.on_record(lambda: _source_ends(e), wait=False):
        return False
    info = {"size": size}
    if digest is not None:
        try:
            sha256 = digest.result()
        except Exception:  # noqa: BLE001 -- stopped or failed: the hasher's results() raises it (Ctrl-C is not caught)
            return False
        if not sha256:
            return False  # no digest to check it by: a resumed run writes it again
        info["sha256"] = sha256
    journal.record(e.name, **info)
    return True


def kept_files(journal: Journal, partial: Path, names: list[str]) -> dict[str, str | None]:
    """Of the finished units `names` (journaled, there at their recorded size), those a resumed run keeps:
    name -> the sha256 the journal recorded for it, checked against the file's bytes now (hashed WRITERS
    at a time; the manifest takes the digest, so each kept shard is read once), or None for one journaled
    without it (a linked input: the inputs' own digests are checked). A shard whose bytes changed in
    OUT.partial since it was written is dropped from the journal and written again, and the user is told."""
    recorded = {n: journal.done[n].get("sha256") for n in names}
    to_check = [n for n in names if recorded[n]]
    with ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="qtool-kept-sha256") as pool:
        now = dict(zip(to_check, pool.map(lambda n: hash_file(partial / n), to_check), strict=True))
    changed = [n for n in to_check if now[n] != recorded[n]]
    for n in changed:
        journal.done.pop(n)
        tell(
            f"resuming: {partial / n} changed since it was written (its sha256 differs from the journal's); "
            "it is written again"
        )
    return {n: recorded[n] for n in names if n not in changed}


def _source_ends(e: Link | Shard) -> dict[str, int]:
    """input path -> the end of the bytes `e` takes from it."""
    if isinstance(e, Link):
        return {e.source: os.path.getsize(e.source)}
    ends: dict[str, int] = {}
    for t in tensors_of(e):
        if isinstance(t.source, FileRange):
            ends[t.source.file] = max(ends.get(t.source.file, 0), t.source.end)
    return ends


def _recorded_link_digests(plan: OutputPlan, known: dict[str, str]) -> dict[str, str]:
    """Digests of linked files that were not hashed as inputs (patch-config -o links every shard of a
    233 GB checkpoint to change one config), taken from the source's own manifest when it records the
    file at the same size; the rest are hashed by output_files."""
    out: dict[str, str] = {}
    recorded: dict[str, dict] = {}
    for root in plan.sources.values():
        if isinstance(root, Path) and (root / MANIFEST_NAME).is_file():
            try:
                files = read_manifest(root / MANIFEST_NAME).get("files") or {}
            except (OSError, ValueError):
                continue
            recorded.update({str(root / rel): v for rel, v in files.items() if isinstance(v, dict)})
    for e in plan.entries(Link):
        rec = recorded.get(e.source)
        if (
            e.name not in known
            and rec
            and isinstance(rec.get("sha256"), str)
            and rec.get("bytes") == os.path.getsize(e.source)
        ):
            out[e.name] = rec["sha256"]
    return out


def _manifest(
    plan: OutputPlan,
    tx: OutputDir,
    digests: dict[str, str],
    command: str | None,
    checks: dict,
    shards_section: Path | None,
    run_extra: dict,
) -> dict:
    """Write the manifest into the partial output; returns its `files` section."""
    partial = tx.partial
    sources = {}
    for name, root in plan.sources.items():
        if isinstance(root, dict):  # already an entry (a Hub repo at a commit)
            sources[name] = root
        else:
            sources[name] = source_entry(
                root, {f: d for f, d in digests.items() if Path(f).is_relative_to(root)}, plan.taken
            )
    extra = {**plan.extra, **run_extra}
    skip = (MANIFEST_NAME, JOURNAL_NAME) + ((shards_section.name,) if shards_section else ())
    if tx.in_place:
        root = next(iter(plan.sources.values()))
        assert isinstance(root, Path)  # in-place work changes a local checkpoint, never a Hub repo
        prev = previous_head(root)
        if prev:
            extra["previous"] = prev
        changed = {e.name for e in plan.files if not isinstance(e, (Link, Remove))}
        files = carried_files(partial, root, changed, digests)
        created = made_by_qtool(root)
    else:
        real = {os.path.realpath(f): d for f, d in digests.items()}
        known = {
            e.name: real[os.path.realpath(e.source)] for e in plan.entries(Link) if os.path.realpath(e.source) in real
        }
        known.update({os.path.relpath(f, partial): d for f, d in digests.items() if Path(f).is_relative_to(partial)})
        known.update(_recorded_link_digests(plan, known))
        files = output_files(partial, known, skip=skip)
        created = True
    write_manifest(
        partial / MANIFEST_NAME,
        kind=plan.kind,
        command=command,
        sources=sources,
        summary=plan.summary,
        checks=checks,
        files=files,
        extra=extra,
        created=created,
        shards_section=shards_section,
    )
    return files
