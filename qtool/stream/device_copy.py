"""A CUDA tensor's bytes to page-locked host memory without a wait on the calling thread.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

`download(t)` queues the copy on the current stream of t's own device (not the thread's current device:
a writer thread starts on device 0, whatever device the job runs on) and records an event there;
`Download.wait()` waits for that event and returns the host bytes. Until then the Download holds `tensor`, so
its device memory cannot be handed to another allocation (another thread's, on another stream) while the
copy still reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Download:
    def __init__(
        self, host: torch.Tensor, ready: torch.cuda.Event | None = None, src: torch.Tensor | None = None
    ) -> None:
        self.host = host  # uint8, page-locked where the source is on CUDA
        self._ready = ready  # a CUDA event, or None: the bytes are there already
        self._src = src

    def wait(self) -> torch.Tensor:
        """The host bytes, once the copy has landed."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = self._src = None
        return self.host


def download(tensor: torch.Tensor) -> Download:
    """`tensor`'s bytes (contiguous, any dtype) as a Download; a host tensor is its own bytes at once."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cuda":
        return Download(flat)
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream(flat.device)
    with torch.cuda.stream(stream):
        host.copy_(flat, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(stream)
    return Download(host, ready, flat)
