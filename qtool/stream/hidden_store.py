"""Where the calibration set's hidden states [N, L, H] live between decoder layers.

A layer reads its input windows from the store and writes its output windows back; `commit()` ends the
layer (reads then see the outputs). In RAM or on the device (MemoryStore, updated in place, batch by batch)
or on disk (DiskStore: files used in turn, so that a crash mid-layer leaves the previous layer's output
intact for --resume), of which only one micro-batch is in RAM at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtool.io.files import fsync_path
from qtool.io.in_order import InOrder
from qtool.stream.device_copy import Download, download
from qtool.stream.layer_read import pread_exact

if TYPE_CHECKING:
    import torch


class HiddenStore:
    """Hidden states [N, L, H] of the calibration set between layers. `read(b0, b1)` gives windows
    b0..b1 of the current layer's input, `write(b0, b1, x)` stores that layer's output, `commit()` ends a
    layer (after which reads see the outputs)."""

    shape: tuple[int, int, int]
    itemsize: int = 2

    def read(self, b0: int, b1: int) -> torch.Tensor: ...
    def write(self, b0: int, b1: int, x: torch.Tensor) -> None: ...
    def commit(self) -> None: ...

    @property
    def nbytes(self) -> int:
        n, seq, h = self.shape
        return n * seq * h * self.itemsize


# The calibration set's hidden states stay on the GPU where two sets (a layer's input and its output) take
# at most this: the layer then reads its input from the device, not the file (a 397B layer's 16 x 2048
# windows are 256 MiB: a 0.2 s read and upload plus a 0.2 s download on the main thread, per layer, on the
# lent H200 machine), and the file written for --resume is written behind from page-locked memory.
HIDDEN_ON_DEVICE_MAX = 4 << 30


def hidden_on_device(device: str, nbytes: int) -> bool:
    """Whether a store of `nbytes` of hidden states keeps them on `device` (the memory plan counts the
    two sets on the GPU where it does)."""
    return str(device).startswith("cuda") and 2 * nbytes <= HIDDEN_ON_DEVICE_MAX


class MemoryStore(HiddenStore):
    def __init__(self, hidden: torch.Tensor) -> None:
        self.t = hidden
        n, seq, h = hidden.shape
        self.shape = (int(n), int(seq), int(h))
        self.itemsize = hidden.element_size()

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dtype: torch.dtype, device: str = "cpu") -> MemoryStore:
        """On `device` where the hidden states fit there (hidden_on_device), else in host RAM."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        n, seq, h = shape
        on = device if hidden_on_device(device, n * seq * h * itemsize) else "cpu"
        return cls(torch.empty(shape, dtype=dtype, device=on))

    def read(self, b0: int, b1: int) -> torch.Tensor:
        # a copy on the device: the layer's output overwrites these windows while a hook may still hold them
        return self.t[b0:b1] if self.t.device.type == "cpu" else self.t[b0:b1].clone()

    def write(self, b0: int, b1: int, x: torch.Tensor) -> None:
        self.t[b0:b1].copy_(x.to(self.t.device, self.t.dtype))

    def commit(self) -> None:
        pass


class DiskStore(HiddenStore):
    """Raw files `hidden.a`, `hidden.b` (, `hidden.c`, `hidden.d`) in `dir`, used in turn: a layer reads
    `current` and writes the next one; `current` names the one holding the last committed layer's output
    (recorded by the caller's journal). With `files=2 + k` the inputs of the k layers whose results are
    still being written (quantize's write-behind) survive the next layer's forward, so a journal that lags
    k layers behind still points at intact hidden states.

    `write_behind=True` (one process only): writes, the end-of-layer fsync and `when_durable` callbacks
    (the caller's journal) run on one writer thread, in order, while the next layer is built; every read
    first waits for them. The layer being written goes to the file the journal does not name, and the
    journal moves on only once those writes are on disk, so a crash at any point resumes correctly.

    `device` (the layers' device): where hidden_on_device holds, the store also keeps on it what it wrote
    to the current file and to the one being written, and reads are served from there (a copy, the same
    values as the file's); the files are still written, from page-locked memory after a non-blocking
    download, behind the forward where `write_behind`. A store opened on a resume reads the files."""

    NAMES = ("a", "b", "c", "d")

    def __init__(
        self,
        dir: Path,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        current: str = "a",
        files: int = 2,
        write_behind: bool = False,
        device: str = "cpu",
    ) -> None:
        import torch

        if not 2 <= files <= len(self.NAMES):
            raise ValueError(f"files must be 2..{len(self.NAMES)}")
        # a failed write stops the fsync and the journal entry queued after it (they would declare the
        # layer's hidden states complete); the queue holds at most one layer's writes (read() drains it)
        self._writer = InOrder(depth=1 << 20, name="qtool-hidden-write") if write_behind else None
        self.dir = Path(dir)
        n, seq, h = shape
        self.shape = (int(n), int(seq), int(h))
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.names = self.NAMES[:files]
        self.current = current if current in self.names else self.names[0]
        self.row = seq * h * self.itemsize
        self.keep_on = device if hidden_on_device(device, self.nbytes) else None
        self._kept: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # file -> (b0, b1) -> device tensor
        for name in self.names:
            path = self.path(name)
            if not path.exists() or path.stat().st_size != self.nbytes:
                with open(path, "ab") as f:
                    f.truncate(self.nbytes)

    def path(self, name: str) -> Path:
        return self.dir / f"hidden.{name}"

    @property
    def other(self) -> str:
        """The file the next layer writes."""
        return self.names[(self.names.index(self.current) + 1) % len(self.names)]

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._writer is None:
            fn(*args)
        else:
            self._writer.call(fn, *args)

    def drain(self) -> None:
        """Wait for the writer thread's queue (its first error is raised here)."""
        if self._writer is not None:
            self._writer.drain()

    def when_durable(self, fn: Callable[[], Any]) -> None:
        """Call fn() once everything written so far is on disk (at once without write-behind)."""
        self._submit(fn)

    def close(self, quiet: bool = False) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        except Exception:
            if not quiet:
                raise
        finally:
            self._kept = {}

    def read(self, b0: int, b1: int) -> torch.Tensor:
        import torch

        self.drain()  # the previous layer's outputs (and its journal) are on disk
        for (k0, k1), t in self._kept.get(self.current, {}).items():
            if k0 <= b0 and b1 <= k1:
                return t[b0 - k0 : b1 - k0].clone()  # the caller's own: the kept set serves later reads too
        # straight into the tensor's memory: one copy (a 397B micro-batch is 268 MB; `bytes` + bytearray
        # took two more)
        buf = torch.empty((b1 - b0) * self.row, dtype=torch.uint8)
        path = self.path(self.current)
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_exact(fd, memoryview(buf.numpy()), b0 * self.row, str(path))
        finally:
            os.close(fd)
        return buf.view(self.dtype).view(b1 - b0, *self.shape[1:])

    def write(self, b0: int, b1: int, x: torch.Tensor, name: str | None = None) -> None:
        import torch

        name = name or self.other
        if self.keep_on is not None and x.device.type == "cuda":
            y = x.detach().to(dtype=self.dtype).contiguous()
            self._kept.setdefault(name, {})[(b0, b1)] = y
            # downloaded without a wait on this thread; the writer waits for the copy, then writes
            self._submit(_pwrite_when, download(y), self.path(name), b0 * self.row)
            return
        if self.keep_on is not None:  # the embeddings (computed on the host): layer 0 reads them from the device
            self._kept.setdefault(name, {})[(b0, b1)] = x.detach().to(self.keep_on, self.dtype)
        data = x.detach().to("cpu", self.dtype).contiguous().view(-1).view(dtype=torch.uint8).numpy()
        self._submit(_pwrite_file, self.path(name), data, b0 * self.row)

    def write_current(self, b0: int, b1: int, x: torch.Tensor) -> None:
        """Write into the current file (used to fill the embeddings before layer 0)."""
        self.write(b0, b1, x, name=self.current)

    def settle_current(self) -> None:
        """The current file's writes (the embeddings) on disk before the caller journals them."""
        self._submit(fsync_path, self.path(self.current))
        self.drain()

    def commit(self) -> None:
        self._submit(fsync_path, self.path(self.other))
        self.current = self.other
        # on the device: the new current set only (the file the next layer writes is rewritten)
        self._kept = {name: kept for name, kept in self._kept.items() if name == self.current}


def _pwrite_file(path: Path, data: Any, off: int) -> None:
    view = memoryview(data)  # no bytes copy
    fd = os.open(path, os.O_WRONLY)
    try:
        while view:  # pwrite may write less than asked on large buffers
            n = os.pwrite(fd, view, off)
            view, off = view[n:], off + n
    finally:
        os.close(fd)


def _pwrite_when(data: Download, path: Path, off: int) -> None:
    """Write a device_copy.Download once its copy has landed."""
    _pwrite_file(path, data.wait().numpy(), off)
