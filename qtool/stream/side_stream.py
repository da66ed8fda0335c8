"""GPU work handed to another thread, on a CUDA stream of its own.

quantize codes layer L's experts on its writer thread while the main thread runs layer L+1's forward. On
the device's one default stream the coder's kernels (and each `.cpu()` or download it waits for) queued
behind that whole forward: the shard's file thread had nothing to write for the first 0.6-0.8 s of every
layer on the lent H200 machine. On a stream of its own, of higher priority, the coder's few short kernels
run between the forward's; `SideStream.handoff()` records where the handing thread's queue stands, and
the work on the side stream starts after it (the layer's weights and statistics are complete there).

Memory stays safe across the streams because the handed-over tensors are held by the job until the side
stream's work on them is done: `run` waits for the side stream when its block ends, also on an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class SideStream:
    """A high-priority CUDA stream on `device`; on the CPU every method is a no-op."""

    def __init__(self, device: str) -> None:
        self.stream = None
        if str(device).startswith("cuda"):
            import torch

            dev = torch.device(device)
            # torch.cuda.Stream priorities: lower is higher; priority_range() is (low, high)
            high = torch.cuda.Stream.priority_range()[1]
            self.stream = torch.cuda.Stream(device=dev, priority=high)

    def handoff(self) -> torch.cuda.Event | None:
        """A mark of everything the calling thread has queued so far on the device (an event), for `run`."""
        if self.stream is None:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.stream.device))
        return ready

    @contextmanager
    def run(self, ready: torch.cuda.Event | None) -> Iterator[None]:
        """Within: the calling thread's work goes to the side stream, after the `handoff` mark `ready`."""
        if self.stream is None or ready is None:  # on the CPU, or work kept on the calling thread
            yield
            return
        import torch

        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            try:
                yield
            finally:
                # nothing queued here outlives the block: the caller then lets go of the handed-over tensors
                # (a failed job skips the downloads it would have waited for)
                self.stream.synchronize()
