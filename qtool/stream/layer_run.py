"""One pass of the layer loop (qtool.stream.layer_stream.LayerStreamer.run_layers) and the stages an op
plugs into it.

A layer goes through named events; the loop calls each stage at each of them, in the stages' order:

    load           keep_bytes(run, idx)           source bytes the stage wants kept with the layer
    forward        before_forward(run, idx, layer) hooks in (statistics, taps); on_batch(b0) per micro-batch
                   (every_window(run, idx): every rank runs every micro-batch, not its share of them)
    after-forward  after_forward(run, idx, layer)  hooks out, statistics settled and reduced over the ranks
    code           code(run, idx, layer)           a LayerWrite: the layer coded and written ...
    write-behind                                    ... on a writer thread while the next layers run
    commit         LayerWrite.commit / at once      in layer order: the journal entry, the clock, progress

A new method (a block-scale search, GPTQ with per-expert Hessians gathered in the forward) is a new stage:
its hooks at `forward`, its statistics at `after-forward`, its coding in the LayerWrite it returns.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qtool.dist import Group
from qtool.io.writer import FileRange
from qtool.stream.hidden_store import DiskStore, HiddenStore
from qtool.stream.layer_journal import LayerJournal
from qtool.stream.side_stream import SideStream

if TYPE_CHECKING:
    import torch

    from qtool.stream.layer_stream import LayerStreamer


class LayerWrite(Protocol):
    """A layer's coding and writing, handed from the loop to a writer thread.

    behind: coded on a writer thread beside the next layers' forward (False: here, after every layer in
    flight: a peer library's state is not thread-safe). prepare(): on the loop's thread, once the layers
    ahead are settled as far as the slots need (several ranks: the file every rank writes its share into).
    write(keep_pace): code and write this rank's share; returns what commit() gets from every rank.
    `keep_pace`: no layer waits for this one (the run's last). commit(shares): in layer order, once every
    rank's share is durable; calls run.layer_done."""

    behind: bool

    def prepare(self) -> None: ...
    def write(self, keep_pace: bool) -> Any: ...
    def commit(self, shares: list[Any]) -> None: ...


class LayerStage:
    """What an op adds to the layer loop; every event is optional (the defaults do nothing)."""

    # whether on_batch(b0) is called before each micro-batch of the forward (AWQ keeps rows in window order)
    sees_batches: bool = False

    def keep_bytes(self, run: LayerRun, idx: int) -> dict[str, FileRange]:
        """Output tensor name -> the source's byte range it copies unchanged (LayerStreamer.load_layer)."""
        return {}

    def before_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None: ...

    def on_batch(self, b0: int) -> None: ...

    def every_window(self, run: LayerRun, idx: int) -> bool:
        """Asked after before_forward: whether every rank must run layer `idx` over every calibration window
        (each still writes only its own windows' outputs), not over its share of them. For statistics that
        one process sums in window order (GPTQ's Hessians): each rank then sums those of the experts it codes
        exactly as one process does. If any stage asks, every stage sees every window: after_forward finds
        `run.every_window` set, and a stage's statistics are then complete on every rank (no reduction)."""
        return False

    def after_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None: ...

    def code(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> LayerWrite | None:
        """The layer's write (None: the stage writes nothing; the layer is committed at once)."""
        return None

    def before_commit(self, run: LayerRun, idx: int) -> None:
        """Just before the journal entry of layer `idx` (e.g. wait for the digests a resume relies on)."""

    def journal_entry(self) -> dict[str, Any]:
        """What the journal keeps of this stage after each layer."""
        return {}


@dataclass
class LayerRun:
    """One pass of the layer loop: the streamer, where the hidden states live, which layers, the stages, and
    the run's flags (they travel here, once). `journal`: the resume record (None: not resumable);
    `file_mode`: the mode of the files the stages write; `layers_in_flight`: layers coded and written behind
    the forward at once (besides the last)."""

    streamer: LayerStreamer
    store: HiddenStore
    seq_len: int
    batch: int
    layers: list[int]
    stages: list[LayerStage] = field(default_factory=list)
    journal: LayerJournal | None = None
    progress: Callable[[int], None] | None = None
    partial: Path | None = None
    file_mode: int = 0o644
    layers_in_flight: int = 1
    writes: WriteBehind | None = None
    # the layer being run went over every window on every rank (LayerStage.every_window), several ranks only
    every_window: bool = False

    @property
    def group(self) -> Group:
        return self.streamer.group

    @property
    def device(self) -> str:
        return self.streamer.device

    def embed(self, ids: torch.Tensor) -> None:
        """Embed token windows `ids` [N, L] into the store as layer 0's input, and journal that."""
        self.streamer.embed_into(ids, self.store, self.batch)
        self.save_journal(0, self._current())

    def layer_done(self, idx: int, current: str) -> None:
        """Layer `idx` is complete (its results durable, its output hidden states in file `current`):
        journaled, timed, reported."""
        if self.journal is not None and self.journal.keeps:
            for stage in self.stages:
                stage.before_commit(self, idx)
            self.streamer.inputs_hashed(idx)  # the digests the journal's resume relies on cover this layer
            self.save_journal(idx + 1, current)
        self.streamer.clock["layers_done"].append(time.time())
        if self.progress is not None:
            self.progress(idx)

    def save_journal(self, next_layer: int, current: str) -> None:
        if self.journal is None or not isinstance(self.store, DiskStore):
            return
        entry: dict[str, Any] = {}
        for stage in self.stages:
            entry.update(stage.journal_entry())
        self.journal.save(next_layer, current, entry, self.store)

    def _current(self) -> str:
        return self.store.current if isinstance(self.store, DiskStore) else ""


@dataclass
class _InFlight:
    future: Future
    write: LayerWrite


class WriteBehind:
    """The layers being coded and written while the next ones load and run: at most `in_flight` of them,
    and the run's last layer besides them, each on a writer thread and a CUDA stream of its own
    (qtool.stream.side_stream). A layer's commit waits for the one ahead of it: the journal never names a
    layer past one not on disk. With several ranks every rank writes its share of a layer, one layer in
    flight; the shares meet (a gather, on the loop's thread) before rank 0 commits."""

    def __init__(self, device: str, group: Group, in_flight: int) -> None:
        import torch

        self.group = group
        self.in_flight = in_flight if group.world == 1 else 1
        # One rank: the last layer is begun beside the ones in flight, not after one of them is written. No
        # layer is read or run after it, so what it holds is what the next layer's forward would have held;
        # and its shard's sha256 (~1.2 GB/s on one core, 3.4 s for a 397B NVFP4 shard: the end of the job)
        # starts a layer write earlier (0.5-1.0 s on the lent H100 machine's /dev/shm, one layer in flight).
        self.writers = self.in_flight + 1 if group.world == 1 else self.in_flight
        self.pending: deque[_InFlight] = deque()  # the layers being written, in order
        # each writer codes beside the next layer's forward, not behind it, on a stream of its own
        self.coders = [SideStream(device) for _ in range(self.writers)]
        self.handed = 0  # layers handed over so far (each takes the next coder in turn)
        # the writer codes on the job's device: a new thread's current CUDA device is 0 whatever the job's is
        init: Callable[..., None] | None = None
        args: tuple = ()
        if device.startswith("cuda"):
            index = torch.device(device).index
            init, args = torch.cuda.set_device, (torch.cuda.current_device() if index is None else index,)
        self.pool = ThreadPoolExecutor(
            max_workers=self.writers, thread_name_prefix="qtool-layer-write", initializer=init, initargs=args
        )

    def hand_over(self, write: LayerWrite, last: bool) -> None:
        """Settle the oldest layers in flight as the slots need (all of them, in order, once one failed: its
        error is raised here, before another layer is begun), prepare `write` and start it (or run it here,
        where it is not written behind). `last`: the run's last layer."""
        failed = any(f.future.done() and f.future.exception() is not None for f in self.pending)
        # a layer coded here comes after every layer in flight; the last layer written behind, beside them
        slots = 1 if not write.behind else self.writers if last else self.in_flight
        while self.pending and (len(self.pending) >= slots or failed):
            self._settle(self.pending.popleft())
        write.prepare()
        if write.behind:
            coder = self.coders[self.handed % self.writers]
            ahead = self.pending[-1].future if self.pending else None
            future = self.pool.submit(self._write, write, coder, coder.handoff(), ahead, last)
            self.pending.append(_InFlight(future, write))
        else:
            share = self._write(write, None, None, None, keep_pace=last)
            self._meet(share, write)
        self.handed += 1

    def finish(self) -> None:
        """Every layer in flight written and committed, in order."""
        while self.pending:
            self._settle(self.pending.popleft())

    def close(self) -> None:
        """Cancel what has not begun, wait for the rest (their errors are not this one's), stop the threads."""
        try:
            for f in self.pending:
                f.future.cancel()
            for f in self.pending:
                # the error that brought us here is the one raised
                with contextlib.suppress(BaseException):
                    f.future.result()
        finally:
            self.pool.shutdown(wait=True)

    def _write(
        self,
        write: LayerWrite,
        coder: SideStream | None,
        ready: Any,
        ahead: Future | None,
        keep_pace: bool,
    ) -> Any:
        """Write this rank's share of the layer; one rank also commits it here, on the writer thread, once
        the layer `ahead` of it has committed. The coding runs on the writer's own CUDA stream, after the
        handoff mark `ready`."""
        import torch

        failed = ahead.exception() if ahead is not None and ahead.done() else None
        if failed is not None:
            raise failed  # the layer ahead failed: this one is not begun
        with torch.no_grad(), coder.run(ready) if coder is not None else nullcontext():
            share = write.write(keep_pace)
        if self.group.world == 1:
            if ahead is not None:
                ahead.result()  # its error is this layer's too: no journal entry past a layer not on disk
            write.commit([share])
        return share

    def _settle(self, entry: _InFlight) -> None:
        """Wait for this rank's share of a layer; with several ranks, meet the others (each share is on disk
        once the gather returns) and commit it on rank 0."""
        self._meet(entry.future.result(), entry.write)  # its error is raised here

    def _meet(self, share: Any, write: LayerWrite) -> None:
        """With several ranks: every rank's share of a layer (each on disk once the gather returns),
        committed on rank 0. On the loop's thread: collectives stay on it."""
        if self.group.world > 1:
            every = self.group.gather(share)
            if self.group.leader:
                write.commit(every)


@contextmanager
def write_behind(run: LayerRun) -> Iterator[None]:
    """The run's writers for the loop's duration: every layer in flight committed on a clean exit, the
    threads stopped on any exit."""
    try:
        yield
        if run.writes is not None:
            run.writes.finish()
    finally:
        if run.writes is not None:
            run.writes.close()
            run.writes = None
