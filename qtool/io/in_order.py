"""A file's operations run in order on a thread of their own, while the caller makes the next ones."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class InOrder:
    """A file's operations (writes, seeks, copies) run in the order given, on a thread of their own, with at
    most `depth` queued: the caller codes the next chunk of a layer while the last one is written (the
    write is the longest step of a quantize layer: ~2 s of it on the lent H200 machine). After a failed
    operation the queued ones are skipped; the error is raised by the next `call` or by `close`, which
    waits for everything queued, so the file is never closed under a write (`abandon`: the caller failed;
    skip what is queued, wait for the one running)."""

    def __init__(self, depth: int = 2, name: str = "qtool-file-write") -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending: deque[Future[None]] = deque()
        self.depth = depth
        self.failed: BaseException | None = None
        self.skip = False
        self.closed = False

    def _run(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        if self.failed is not None or self.skip:
            return
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 -- raised by the caller's next call or close
            self.failed = e

    def _raise(self) -> None:
        if self.failed is not None:
            raise self.failed

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        while self.pending and (len(self.pending) >= self.depth or self.pending[0].done()):
            self.pending.popleft().result()
        self._raise()
        self.pending.append(self.pool.submit(self._run, fn, args))

    def drain(self) -> None:
        """Wait for every queued operation; raise the first error (again on each call)."""
        while self.pending:
            self.pending.popleft().result()
        self._raise()

    def close(self) -> None:
        """drain(), and end the thread."""
        try:
            self.drain()
        finally:
            self._shutdown()

    def abandon(self) -> None:
        """The caller failed: skip the queued operations, wait for the one running; raise nothing."""
        self.skip = True
        self.pending.clear()
        self._shutdown()

    def _shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.shutdown(wait=True)
