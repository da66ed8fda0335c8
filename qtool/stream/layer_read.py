"""A decoder layer's tensor bytes in a few large reads, one layer ahead of the compute.

A 397B layer is ~3,100 tensors (512 experts x 3 projections x NVFP4's 4 params, or x 1 in BF16) that
lie next to each other in one or two shards. Read one by one they cost 3,072 small `preadv` calls and as
many host->device copies, one after the other; here the byte ranges of a layer are coalesced per shard
(gaps up to MAX_GAP are read through), each run read in CHUNK pieces, and on CUDA every piece goes
through one of two pinned staging buffers to the device asynchronously on a side stream, so the disk,
the copy engine and the compute work at the same time. Tensors are then views of the device buffer
(`get`), so dequantization runs on the device.

`Prefetcher` reads layer L+1 in a thread while layer L computes (bounded: one layer ahead), READERS
threads to a layer. Memory: the device holds the raw bytes of at most two layers (the one in use and the
one being read); the host only the staging buffers, 2 x CHUNK per reader (CPU: the raw layer itself,
read straight into its tensor).

The runs are read around the page cache (`O_DIRECT`), a whole piece a call, where the filesystem allows it;
elsewhere (a filesystem that refuses it) through the page cache in READ_PIECE calls; bytes the page cache
holds already are copied from there, a piece a call (`ShardFiles`). Why the first two matter:
- An 800 GB input does not fit the page cache. A page read by the kernel for a call but dropped before it
  is copied out is read again; the longer a buffered call, the more of them (READ_PIECE below). Direct
  reads have no such pages: the input is read once whatever the call's length.
- Each call's return needs the interpreter back, which a busy main thread holds up to the 5 ms switch
  interval: short calls starve the readers while the main thread runs Python (the output plan, a layer's
  dispatch). Direct reads take a whole CHUNK a call.
A direct read's offset, length and buffer are multiples of ALIGN, so a run is read from the block before
its first byte to the block after its last; only the run's own bytes are used and hashed.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.errors import PlanError
from qtool.io import page_cache
from qtool.io.dtypes import TORCH_DTYPE_NAMES
from qtool.io.input_files import InputFiles, open_direct, open_for_reads
from qtool.io.safetensors_header import TensorInfo
from qtool.io.stream_digest import NO_DIGESTS, DigestSink

if TYPE_CHECKING:
    import torch

MAX_GAP = 1 << 20  # read through holes up to 1 MiB (another layer's norm, a header) rather than split
CHUNK = 64 << 20  # one preadv (a direct read) and one host->device copy
# the most one preadv call through the page cache asks for (a filesystem without direct reads, and single
# tensors' reads). The kernel reads up to min(call, max(io_pages, ra_pages)) of a call's pages before it
# copies them out, and where the input does not fit the page cache a page read but not yet copied can be
# dropped and read again: with tests/contract/test_one_read.py's dropper on the VM's disk (an 8 MiB window),
# 1 MiB calls read 1.017-1.038x the input, 64 MiB calls 1.034-1.132x, direct 64 MiB reads 1.008-1.011x.
# The cost of short calls: each return needs the interpreter back, which a busy main thread holds up to
# the 5 ms switch interval (on the H200, 4 readers read 0.64 GB/s beside a Python loop in 1 MiB calls,
# 8.94 GB/s in 64 MiB calls, measured with the page cache warm)
READ_PIECE = 1 << 20
READERS = 4  # threads reading one layer (each with its own pinned staging pair on CUDA)
# O_DIRECT's alignment of file offsets, lengths and buffer addresses: the device's logical block size, 512
# or 4096 bytes; 4096 serves both
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)  # (Linux's; elsewhere every read goes through the page cache)


@dataclass
class _Run:
    file: str
    start: int
    end: int
    tensors: list[TensorInfo]


@dataclass
class Piece:
    """One read: the file's bytes [start, end) (ALIGN-aligned; `end` may pass the file's end, where the
    read stops), of which the run's own are [lo, hi)."""

    path: str
    start: int
    end: int
    lo: int
    hi: int
    # CUDA: the run's bytes [lo, hi) on the device; CPU: the host buffer [start, end) is read into
    dst: Any = None  # a torch.Tensor, once the piece's buffer is made


def coalesce(infos: list[TensorInfo], max_gap: int = MAX_GAP) -> list[_Run]:
    """The byte runs covering `infos`, per shard in file order; tensors closer than `max_gap` share one."""
    runs: list[_Run] = []
    for info in sorted(infos, key=lambda i: (i.file, i.start)):
        last = runs[-1] if runs else None
        if last is not None and last.file == info.file and info.start - last.end <= max_gap:
            last.end = max(last.end, info.end)
            last.tensors.append(info)
        else:
            runs.append(_Run(info.file, info.start, info.end, [info]))
    return runs


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return _down(n + ALIGN - 1)


def aligned_empty(n: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of `n` bytes whose address is a multiple of ALIGN (a direct read's buffer)."""
    import torch

    # pinned memory comes page-aligned, and the pinned allocator rounds a size up to a power of two (n +
    # ALIGN would double a staging buffer): n first there; a large CPU tensor is 64-byte aligned only
    raw = torch.empty(n, dtype=torch.uint8, pin_memory=True) if pin else None
    if raw is None or raw.data_ptr() % ALIGN:
        raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift : shift + n]


def read_pieces(path: str, lo: int, hi: int) -> list[Piece]:
    """Bytes [lo, hi) of `path` as the reader reads them: CHUNK pieces over the ALIGN-aligned extent."""
    first, last = _down(lo), _up(hi)
    return [
        Piece(path, start, min(start + CHUNK, last), max(start, lo), min(start + CHUNK, hi))
        for start in range(first, last, CHUNK)
    ]


class LayerBytes:
    """The tensors `infos`, read in coalesced runs onto `device`; `get(info)` is a view, no copy. Each piece
    read is handed to `digests` (the job's inputs hashed from its reads: qtool.io.stream_digest)."""

    def __init__(self, infos: list[TensorInfo], device: str = "cpu", digests: DigestSink = NO_DIGESTS) -> None:
        self.runs = coalesce(infos)
        self.device = device
        self.digests = digests
        self._where: dict[str, tuple[int, int]] = {}  # tensor name -> (run, offset in the run)
        for k, run in enumerate(self.runs):
            for info in run.tensors:
                self._where[info.name] = (k, info.start - run.start)
        self._bufs: list = []
        self.nbytes = sum(r.end - r.start for r in self.runs)

    def _pieces(self, run: _Run) -> list[Piece]:
        """The run's pieces (`read_pieces`), each with its destination; allocates the run's buffer."""
        import torch

        pieces = read_pieces(run.file, run.start, run.end)
        first = pieces[0].start if pieces else run.start  # (none: a run of empty tensors)
        if self.device == "cpu":  # read straight into the run's buffer: its extent's blocks, aligned
            host = aligned_empty(pieces[-1].end - first if pieces else 0)
            buf = host[run.start - first : run.end - first]
            for p in pieces:
                p.dst = host[p.start - first : p.end - first]
        else:
            buf = torch.empty(run.end - run.start, dtype=torch.uint8, device=self.device)
            for p in pieces:
                p.dst = buf[p.lo - run.start : p.hi - run.start]
        self._bufs.append(buf)
        return pieces

    def read(self, staging: list[_Staging] | None = None) -> LayerBytes:
        """Read every run, its CHUNK pieces spread over READERS threads (one staging pair each on CUDA):
        a single reader leaves an NVMe array, and a sandboxed page cache, well below their speed."""
        import torch

        cuda = self.device != "cpu"
        stages = staging or []  # (given on CUDA only)
        pieces = [p for run in self.runs for p in self._pieces(run)]
        workers = len(stages) if cuda else READERS
        if cuda and self.runs:
            # the buffers came from the device's default stream, where kernels queued before their
            # allocation may still use that memory (tensors another thread freed): the uploads, on side
            # streams, wait for those kernels first
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(torch.device(self.device)))
            for s in stages:
                s.stream.wait_event(allocated)
        errors: list[BaseException] = []
        # the input's sha256 is computed from these reads (qtool.io.stream_digest): every piece is claimed
        # first, so the digest waits for them rather than reading their bytes itself
        digests = self.digests
        for p in pieces:
            digests.claim(p.path, p.lo, p.hi)

        def work(k: int) -> None:
            files = ShardFiles(digests)
            try:
                for p in pieces[k::workers]:
                    if errors:
                        return
                    if cuda:
                        stages[k].upload(files, p)
                    else:
                        digests.offer(p.path, p.lo, files.read(p, memoryview(p.dst.numpy())))
                if cuda:
                    stages[k].finish()
            except BaseException as e:
                errors.append(e)
                for p in pieces:  # the digest reads what will not be offered
                    digests.release(p.path, p.lo)
            finally:
                files.close()

        threads = [threading.Thread(target=work, args=(k,), name=f"qtool-read-{k}") for k in range(1, workers)]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self

    def has(self, info: TensorInfo) -> bool:
        return info.name in self._where

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The file bytes of `info` (uint8, a view on the device they were read to)."""
        where = self._where.get(info.name)
        if where is None:
            raise PlanError("tensor was not read with its layer", tensor=info.name, path=info.file)
        k, off = where
        return self._bufs[k][off : off + info.nbytes]

    def span(self, file: str, start: int, end: int) -> torch.Tensor | None:
        """Bytes [start, end) of `file` (uint8, a view on the device they were read to), or None where no
        run read them all: a slice of a tensor (one expert of a fused source) as well as a whole one."""
        for k, run in enumerate(self.runs):
            if run.file == file and run.start <= start and end <= run.end:
                return self._bufs[k][start - run.start : end - run.start]
        return None

    def get(self, info: TensorInfo) -> torch.Tensor:
        """The tensor `info` as a view of the read bytes (on the device it was read to)."""
        import torch

        raw = self.raw(info)
        dtype = getattr(torch, TORCH_DTYPE_NAMES[info.dtype])
        if info.nbytes == 0:
            return torch.empty(tuple(info.shape), dtype=dtype, device=self.device)
        # safetensors does not align offsets, and a CPU run's buffer starts inside an aligned block: a view
        # needs whole elements from the storage's start
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).reshape(tuple(info.shape))

    def close(self) -> None:
        self._bufs.clear()


class ShardFiles:
    """One reader thread's descriptors (of the files the job opened once, handed over with its digests:
    `digests.inputs`, qtool.io.input_files) and its choice of read for each piece:
    - bytes the page cache holds already (a re-run on an input that fits memory; the output the previous
      job just wrote): copied from there, one call (nothing is read from the disk, so nothing twice);
    - else around the page cache (`O_DIRECT`), one call, where the filesystem allows it;
    - else, and for a piece the input's digest has no room for (it is read again there, from the page
      cache while it is still there), through the page cache in READ_PIECE calls."""

    def __init__(self, digests: DigestSink = NO_DIGESTS) -> None:
        self.digests = digests
        self.direct: dict[str, int | None] = {}
        self.buffered: dict[str, int] = {}

    def read(self, piece: Piece, view: memoryview) -> memoryview:
        """Read the piece into `view` (its [start, end), ALIGN-aligned); the run's bytes [lo, hi) of it."""
        own = view[piece.lo - piece.start : piece.hi - piece.start]
        buffered_fd = self._buffered(piece.path)
        if page_cache.resident(buffered_fd, piece.lo, len(own)):
            got = _read_upto(buffered_fd, own, piece.lo, len(own))
        else:
            got = self._read_direct(piece, view)
            # the rest through the page cache: all of it where direct reads are not to be, and what a
            # direct read returned short of (a filesystem's short count, or the file's end: read as 0 here)
            got += _read_upto(buffered_fd, own[got:], piece.lo + got, READ_PIECE)
        if got < len(own):
            raise _truncated(piece.path, None, self.digests.inputs)
        return own

    def _read_direct(self, p: Piece, view: memoryview) -> int:
        """How many of the bytes [lo, hi) were read around the page cache (0: they are to be read through
        it)."""
        if self.digests.queue_full(p.path, p.hi - p.lo):
            return 0
        fd = self._direct(p.path)
        if fd is None:
            return 0
        try:
            got = _read_upto(fd, view, p.start, len(view), direct=True)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: refused for this file after all (an odd filesystem)
                raise
            os.close(fd)
            self.direct[p.path] = None
            return 0
        return min(max(got - (p.lo - p.start), 0), p.hi - p.lo)

    def _buffered(self, path: str) -> int:
        fd = self.buffered.get(path)
        if fd is None:
            fd = self.buffered[path] = open_for_reads(path, self.digests.inputs)
        return fd

    def _direct(self, path: str) -> int | None:
        if path not in self.direct:
            self.direct[path] = open_direct(path, self.digests.inputs)  # None: this filesystem has no direct reads
        return self.direct[path]

    def close(self) -> None:
        for fd in [*self.direct.values(), *self.buffered.values()]:
            if fd is not None:
                os.close(fd)


def _read_upto(fd: int, view: memoryview, offset: int, call: int, direct: bool = False) -> int:
    """Fill `view` from `fd` at `offset` in calls of at most `call` bytes (preadv returns short counts on
    large reads); the bytes read, fewer only where the file ends."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got : got + call]], offset + got)
        got += max(n, 0)
        if n <= 0 or (direct and got % ALIGN):  # a direct read goes on only from a block's start
            break
    return got


def _truncated(path: str, tensor: str | None, inputs: InputFiles | None) -> PlanError:
    if inputs is not None:
        inputs.check_one(path)  # (shortened while the job ran: that is the error to name)
    return PlanError(
        "shard ended before the layer's tensor bytes" if tensor is None else "shard ended before the tensor's bytes",
        path=path,
        tensor=tensor,
        hint="the shard is truncated: re-download or rebuild it",
    )


def pread_exact(
    fd: int,
    view: memoryview,
    offset: int,
    path: str,
    tensor: str | None = None,
    reused: bool = False,
    digests: DigestSink = NO_DIGESTS,
) -> None:
    """Fill `view` from `fd` at `offset`; a shard that ends early is a named error. The bytes feed the
    input's sha256 when the job hashes it from its reads (`digests`: qtool.io.stream_digest; `reused`: the
    buffer is overwritten soon, so the digest takes a copy)."""
    digests.claim(path, offset, offset + len(view))
    try:
        # at most READ_PIECE a call (above: a page of a long call can be dropped before it is copied)
        if _read_upto(fd, view, offset, READ_PIECE) < len(view):
            raise _truncated(path, tensor, digests.inputs)
    except BaseException:
        digests.release(path, offset)
        raise
    digests.offer(path, offset, view, (lambda: bytearray(view)) if reused else None)


class _Staging:
    """Two pinned host buffers: while one is copied to the device (side stream), the next chunk is read
    into the other."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.host = [aligned_empty(CHUNK, pin=True) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]  # the event after which buffer i may be overwritten
        self.turn = 0

    def upload(self, files: ShardFiles, piece: Piece) -> None:
        i = self.turn
        self.turn ^= 1
        done = self.done[i]
        if done is not None:
            done.synchronize()
        host = self.host[i][: piece.end - piece.start]
        own = files.read(piece, memoryview(host.numpy()))
        files.digests.offer(piece.path, piece.lo, own, lambda: bytearray(own))
        with self.torch.cuda.stream(self.stream):
            piece.dst.copy_(host[piece.lo - piece.start : piece.hi - piece.start], non_blocking=True)
            ev = self.torch.cuda.Event()
            ev.record(self.stream)
        self.done[i] = ev

    def finish(self) -> None:
        self.stream.synchronize()


class Prefetcher:
    """Reads the next layer's bytes in a background thread: `start(key, infos)` begins, `take(key)`
    waits and returns the LayerBytes (an error in the thread is raised here). Its reads are handed to
    `digests` (LayerBytes)."""

    def __init__(self, device: str = "cpu", digests: DigestSink = NO_DIGESTS) -> None:
        self.device = device
        self.digests = digests
        self._staging: list[_Staging] | None = None
        self._thread: threading.Thread | None = None
        self._key: object = None
        self._result: LayerBytes | None = None
        self._error: BaseException | None = None

    def _stage(self) -> list[_Staging] | None:
        if self.device != "cpu" and self._staging is None:
            self._staging = [_Staging(self.device) for _ in range(READERS)]
        return self._staging

    def read_now(self, infos: list[TensorInfo]) -> LayerBytes:
        return LayerBytes(infos, self.device, self.digests).read(self._stage())

    def start(self, key: object, infos: list[TensorInfo]) -> None:
        self.wait()
        self._key, self._result, self._error = key, None, None
        staging = self._stage()

        def work() -> None:
            try:
                self._result = LayerBytes(infos, self.device, self.digests).read(staging)
            except BaseException as e:  # handed to take()
                self._error = e

        self._thread = threading.Thread(target=work, name="qtool-layer-read", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, key: object) -> LayerBytes | None:
        """The prefetched bytes of `key`, or None when another (or no) layer was prefetched."""
        if self._key != key:
            return None
        self.wait()
        self._key = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        res, self._result = self._result, None
        return res

    def close(self) -> None:
        self.wait()
        self._result = None
        self._key = None
