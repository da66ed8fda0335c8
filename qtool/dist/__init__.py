"""Data parallel over calibration windows, on torch.distributed (gloo on CPUs, NCCL + gloo on GPUs).

A run with several ranks is the same command run once per rank (qtool.dist.launch starts them for
`--nproc N` / `--devices a,b`; `torchrun` works too: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT). Every
rank plans the same job and streams the same layers (each reads them itself: the first reader pulls a
layer from disk, the page cache serves the others). The calibration windows are cut into the same
micro-batches as in a one-process run and micro-batch b goes to rank b % world, so every micro-batch is
computed exactly as it would be alone; the statistics are then reduced exactly (max of amaxes, sum of
counts, AWQ rows merged in window order), so the results do not depend on the number of ranks. Sums that
one process adds window by window in float32 (GPTQ's and local_hessian's per-expert Hessians) cannot be
reduced so: for those layers every rank runs every micro-batch and sums those of the experts it codes
(qtool.stream.layer_run.LayerStage.every_window), writing the hidden states of its own micro-batches only. The
weight side (quantize's codecs and scale searches) is split by chunk of experts, each rank writing its
experts' bytes into the layer's shard file. Rank 0 owns the output transaction and the journal; the
hidden states live in one shared set of files indexed by window, which is what lets `--resume` continue
with any number of ranks.

`current()` gives this process's Group: a one-rank Group (every collective the identity) unless the
environment says otherwise, so each op has one code path.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from qtool.errors import QtoolError
from qtool.process_exit import end_now

TIMEOUT_ENV = "QTOOL_DIST_TIMEOUT"  # seconds a collective may wait for the other ranks (default 600)


class RankError(QtoolError):
    """Another rank failed (or the ranks disagree): this rank stops with the reason."""

    exit_code = 1


@dataclass
class Group:
    rank: int = 0
    world: int = 1
    device: str | None = None  # this rank's device when the launch chose it (--devices / LOCAL_RANK)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mine(self, n_batches: int) -> list[int]:
        """The micro-batches (0..n-1, in order) this rank computes."""
        return list(range(self.rank, n_batches, self.world))

    # ---- collectives (identities for one rank) -----------------------------------------------------
    def max_(self, t):
        """Element-wise max over ranks of a CPU tensor, in place; returns it."""
        return self._reduce(t, "MAX")

    def sum_(self, t):
        return self._reduce(t, "SUM")

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        self._call(dist.all_gather_object, out, obj)
        return out

    def gather_to(self, obj, dst: int) -> list | None:
        """Every rank's `obj`, in rank order, on rank `dst` only (None on the others)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == dst else None
        self._call(dist.gather_object, obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            self._call(dist.barrier)

    def agree(self, what: str, value) -> None:
        """Stop every rank with a clear error when the ranks do not hold the same `value` (e.g. their
        plans): a launch mixing different commands or inputs would otherwise compute nonsense."""
        values = self.gather(value)
        if any(v != values[0] for v in values):
            raise RankError(
                f"the ranks disagree on {what}: {values}",
                hint="every rank must run the same command on the same inputs",
            )

    def _reduce(self, t, op: str):
        if self.world > 1:
            import torch.distributed as dist

            self._call(dist.all_reduce, t, op=getattr(dist.ReduceOp, op))
        return t

    def _call(self, fn, *a, **k):
        try:
            return fn(*a, **k)
        except (RuntimeError, ConnectionError) as e:  # gloo/NCCL: a peer closed, timed out or failed
            then = (
                "if the run had started writing, its partial output is kept: re-run with --resume (with any "
                "number of ranks)"
                if resumable
                else "run the command again"
            )
            raise RankError(
                f"rank {self.rank}: lost the other ranks ({type(e).__name__}: {str(e)[:200]})",
                hint=f"another rank failed (its error is printed above) or was killed; {then}",
            ) from None


_current: Group | None = None
# whether the command these ranks run has --resume (the CLI sets it in each rank): what a lost rank's hint offers
resumable = True


def current() -> Group:
    """This process's Group, set up from the environment on first use."""
    global _current
    if _current is None:
        _current = _from_env()
    return _current


def _from_env() -> Group:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Group()
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    devices = [d for d in os.environ.get("QTOOL_DEVICES", "").split(",") if d]
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = devices[local] if devices else None
    backend = "gloo"
    if device and device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device).index or 0)
        backend = "cpu:gloo,cuda:nccl"  # the small statistics are reduced on the host (gloo)
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, ValueError, ConnectionError) as e:
        raise RankError(
            f"rank {rank}: could not join the {world} ranks ({str(e)[:200]})",
            hint="MASTER_ADDR/MASTER_PORT must name a reachable rank 0; use --nproc or torchrun",
        ) from None
    import atexit

    # for library callers: torch's process group owns C++ threads, which can abort the interpreter's
    # teardown (SIGABRT); the CLI goes further and skips that teardown (end_rank)
    atexit.register(dist.destroy_process_group)
    return Group(rank, world, device)


def end_rank(code: int) -> None:
    """Exit a rank of several with `code` once its command is done (its files are fsynced, its output
    flushed here), skipping the interpreter's teardown: gloo's C++ threads still hold tensors then, and
    freeing them while Python finalises aborts the process now and then ("terminate called without an
    active exception", SIGABRT: a clean run reported as a dead rank; seen in CI even with the process
    group destroyed at exit). The kernel closes the sockets; the other ranks have no collective left
    with this one. No-op in one process."""
    if _current is None or _current.world == 1:
        return

    end_now(code, exit_handlers=False)  # not even destroy_process_group's (registered above)


def planned_ranks() -> int:
    """How many ranks the job runs on (a dry run of `--nproc N` plans for N without starting them)."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("QTOOL_PLANNED_RANKS") or 1)
