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
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from qtool.errors import PlanError
from qtool.io import stream_digest
from qtool.io.files import open_for_reads
from qtool.io.safetensors_header import TensorInfo

MAX_GAP = 1 << 20  # read through holes up to 1 MiB (another layer's norm, a header) rather than split
CHUNK = 64 << 20  # one preadv and one host->device copy
# the most one preadv call asks for. The kernel reads up to min(call, max(io_pages, ra_pages)) of a call's
# pages before it copies them out, and where the input does not fit the page cache a page read but not yet
# copied can be dropped and read again: with tests/ops/test_one_read.py's dropper on the VM's disk (an 8 MiB
# window), 1 MiB calls read 1.017-1.038x the input, 64 MiB calls 1.034-1.132x. The cost of short calls:
# each return needs the interpreter back, which a busy main thread holds up to the 5 ms switch interval
# (on the H200, 4 readers read 0.64 GB/s beside a Python loop in 1 MiB calls, 8.94 GB/s in 64 MiB calls:
# scripts/bench_read_beside_python.py); session 32 measured both and kept the one read
READ_PIECE = 1 << 20
READERS = 4  # threads reading one layer (each with its own pinned staging pair on CUDA)


@dataclass
class _Run:
    file: str
    start: int
    end: int
    tensors: list[TensorInfo]


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


class LayerBytes:
    """The tensors `infos`, read in coalesced runs onto `device`; `get(info)` is a view, no copy."""

    def __init__(self, infos: list[TensorInfo], device: str = "cpu") -> None:
        self.runs = coalesce(infos)
        self.device = device
        self._where: dict[str, tuple[int, int]] = {}  # tensor name -> (run, offset in the run)
        for k, run in enumerate(self.runs):
            for info in run.tensors:
                self._where[info.name] = (k, info.start - run.start)
        self._bufs: list = []
        self.nbytes = sum(r.end - r.start for r in self.runs)

    def read(self, staging: list[_Staging] | None = None) -> LayerBytes:
        """Read every run, its CHUNK pieces spread over READERS threads (one staging pair each on CUDA):
        a single reader leaves an NVMe array, and a sandboxed page cache, well below their speed."""
        import torch

        cuda = self.device != "cpu"
        pieces = []
        for run in self.runs:
            n = run.end - run.start
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._bufs.append(buf)
            pieces += [(run.file, run.start + off, buf[off:off + min(CHUNK, n - off)]) for off in range(0, n, CHUNK)]
        workers = len(staging) if cuda else READERS
        if cuda and self.runs:
            # the buffers came from the device's default stream, where kernels queued before their
            # allocation may still use that memory (tensors another thread freed): the uploads, on side
            # streams, wait for those kernels first
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(torch.device(self.device)))
            for s in staging:
                s.stream.wait_event(allocated)
        errors: list[BaseException] = []
        # the input's sha256 is computed from these reads (qtool.io.stream_digest): every piece is claimed
        # first, so the digest waits for them rather than reading their bytes itself
        for path, offset, dst in pieces:
            stream_digest.claim(path, offset, offset + dst.numel())

        def work(k: int) -> None:
            fds: dict[str, int] = {}
            try:
                for path, offset, dst in pieces[k::workers]:
                    if errors:
                        return
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = open_for_reads(path)
                    if cuda:
                        staging[k].upload(fd, offset, dst.numel(), dst, path)
                    else:
                        pread_exact(fd, memoryview(dst.numpy()), offset, path)
                if cuda:
                    staging[k].finish()
            except BaseException as e:
                errors.append(e)
                for path, offset, _ in pieces:  # the digest reads what will not be offered
                    stream_digest.release(path, offset)
            finally:
                for fd in fds.values():
                    os.close(fd)

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

    def raw(self, info: TensorInfo):
        """The file bytes of `info` (uint8, a view on the device they were read to)."""
        where = self._where.get(info.name)
        if where is None:
            raise PlanError("tensor was not read with its layer", tensor=info.name, path=info.file)
        k, off = where
        return self._bufs[k][off:off + info.nbytes]

    def span(self, file: str, start: int, end: int):
        """Bytes [start, end) of `file` (uint8, a view on the device they were read to), or None where no
        run read them all: a slice of a tensor (one expert of a fused source) as well as a whole one."""
        for k, run in enumerate(self.runs):
            if run.file == file and run.start <= start and end <= run.end:
                return self._bufs[k][start - run.start:end - run.start]
        return None

    def get(self, info: TensorInfo):
        """The tensor `info` as a view of the read bytes (on the device it was read to)."""
        import torch

        from qtool.io.dtypes import TORCH_DTYPE_NAMES

        raw = self.raw(info)
        off = self._where[info.name][1]
        dtype = getattr(torch, TORCH_DTYPE_NAMES[info.dtype])
        if info.nbytes == 0:
            return torch.empty(tuple(info.shape), dtype=dtype, device=self.device)
        if off % dtype.itemsize:  # safetensors does not align offsets: a view needs whole elements
            raw = raw.clone()
        return raw.view(dtype).reshape(tuple(info.shape))

    def close(self) -> None:
        self._bufs.clear()


def pread_exact(fd: int, view: memoryview, offset: int, path: str, tensor: str | None = None,
                reused: bool = False) -> None:
    """Fill `view` from `fd` at `offset` (preadv returns short counts on large reads); a shard that ends
    early is a named error. The bytes feed the input's sha256 when the job hashes it from its reads
    (qtool.io.stream_digest; `reused`: the buffer is overwritten soon, so the digest takes a copy)."""
    got = 0
    stream_digest.claim(path, offset, offset + len(view))
    try:
        while got < len(view):
            # at most READ_PIECE a call (above: a page of a long call can be dropped before it is copied)
            n = os.preadv(fd, [view[got:got + READ_PIECE]], offset + got)
            if n <= 0:
                raise PlanError("shard ended before the layer's tensor bytes" if tensor is None
                                else "shard ended before the tensor's bytes", path=path, tensor=tensor,
                                hint="the shard is truncated: re-download or rebuild it")
            got += n
    except BaseException:
        stream_digest.release(path, offset)
        raise
    stream_digest.offer(path, offset, view, (lambda: bytearray(view)) if reused else None)


class _Staging:
    """Two pinned host buffers: while one is copied to the device (side stream), the next chunk is read
    into the other."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.host = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.done = [None, None]  # the event after which buffer i may be overwritten
        self.turn = 0

    def upload(self, fd: int, offset: int, n: int, dst, path: str) -> None:
        i = self.turn
        self.turn ^= 1
        if self.done[i] is not None:
            self.done[i].synchronize()
        host = self.host[i][:n]
        pread_exact(fd, memoryview(host.numpy()), offset, path, reused=True)
        with self.torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)
            ev = self.torch.cuda.Event()
            ev.record(self.stream)
        self.done[i] = ev

    def finish(self) -> None:
        self.stream.synchronize()


class Prefetcher:
    """Reads the next layer's bytes in a background thread: `start(key, infos)` begins, `take(key)`
    waits and returns the LayerBytes (an error in the thread is raised here)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._staging = None
        self._thread: threading.Thread | None = None
        self._key = None
        self._result: LayerBytes | None = None
        self._error: BaseException | None = None

    def _stage(self):
        if self.device != "cpu" and self._staging is None:
            self._staging = [_Staging(self.device) for _ in range(READERS)]
        return self._staging

    def read_now(self, infos: list[TensorInfo]) -> LayerBytes:
        return LayerBytes(infos, self.device).read(self._stage())

    def start(self, key, infos: list[TensorInfo]) -> None:
        self.wait()
        self._key, self._result, self._error = key, None, None
        staging = self._stage()

        def work() -> None:
            try:
                self._result = LayerBytes(infos, self.device).read(staging)
            except BaseException as e:  # handed to take()
                self._error = e

        self._thread = threading.Thread(target=work, name="qtool-layer-read", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, key) -> LayerBytes | None:
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
